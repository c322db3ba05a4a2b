"""Put on a vLLM instance's PYTHONPATH by a test: with NEURON_DISAGG_TEST_BREAK_RECEIVER set, D's
push receiver thread raises on the first decode leg it hears of, as a bug in it would. Nothing of
the product reads this; it breaks the real thread from outside, in the real process."""

import os

if os.environ.get("NEURON_DISAGG_TEST_BREAK_RECEIVER"):
    from neuron_disagg.transfer import receiver

    def _expect(self, item, now):
        raise RuntimeError("a bug in the receiver, injected by the test")

    receiver.PushReceiver._expect = _expect
