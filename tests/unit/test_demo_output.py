"""What the demo prints of the random tiny model's answers: something a person can read."""

from neuron_disagg.demo.served import readable


def test_a_random_models_answer_is_shown_without_control_characters_and_cut_to_a_line():
    raw = "abric\x03kenorabrico\x1b[31m\n\n  seven\tlazy" + "x" * 200
    shown = readable(raw, width=40)
    assert all(c.isprintable() for c in shown) and "\x1b" not in shown and "\n" not in shown
    assert shown.startswith("abric·kenorabrico·[31m seven lazy") and len(shown) == 40 and shown.endswith("…")


def test_a_short_printable_answer_is_shown_as_it_is():
    assert readable("the quick brown fox") == "the quick brown fox"
