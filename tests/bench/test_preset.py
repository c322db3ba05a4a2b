"""`neuron-disagg bench --preset`: what a preset sets (and what flags beside it override), the rates
from P's measured prefill time, the churn that fragments the pools, descriptors per transfer read
from /metrics, and the goals judged from a run's results."""

from __future__ import annotations

import json
import time

import pytest

from neuron_disagg.bench import cli, report
from neuron_disagg.bench.load import (ConnectorReading, Load, RunResult, bench_serve_command,
                                      descriptors_per_transfer, heavy_tailed_dataset, mean_imbalance, parse_router,
                                      pool_churn_prompts)
from neuron_disagg.bench.preset import LIGHT, PRESETS, SEED, SHIFT, evaluate, rates_for
from neuron_disagg.bench.topology import ServerSettings, groups, router_args, router_mode
from neuron_disagg.demo import tiny_model


def result(mode, ttft, tpot=10.0, p99=None, rate=1.0, **kw) -> RunResult:
    return RunResult(mode, rate, 512, 32, 16, completed=16, ttft_p50_ms=ttft, ttft_p99_ms=p99 or ttft * 2,
                     tpot_p50_ms=tpot, **kw)


def test_a_preset_sets_its_workload_and_flags_beside_it_win():
    args = cli.parse(["--preset", "seed"])
    assert (args.input_lens, args.p_busy, args.churn, args.rounds) == (SEED.input_lens, [0.8], True, 3)
    assert args.kv_cache_bytes == SEED.kv_cache_bytes and args.max_model_len >= SEED.input_lens[0] + args.output_len
    args = cli.parse(["--preset", "seed", "--rounds", "2", "--input-lens", "1024"])
    assert (args.rounds, args.input_lens, args.p_busy) == (2, [1024], [0.8])
    args = cli.parse(["--preset", "seed", "--rates", "0.5"])
    assert (args.rates, args.p_busy) == ([0.5], [])  # rates given: no capacity-derived rate
    with pytest.raises(SystemExit):
        cli.parse(["--rates", "1", "--p-busy", "0.8"])
    light = cli.parse(["--preset", "light"])
    assert (light.rates, light.input_lens, light.p_busy, light.churn) == ([1.0, 2.0], [512], [], False)
    assert cli.parse([]).preset is None and cli.parse([]).rounds == 1  # no preset: the defaults as before
    with pytest.raises(SystemExit):
        cli.parse(["--preset", "heavy"])


def test_the_seed_model_is_kv_heavy_for_its_compute():
    """Per token, its KV for each weight it multiplies is several times the default tiny model's:
    what a 32B model's KV is to its compute on a TP rank, scaled down."""
    def kv_bytes(s):
        return 2 * s["layers"] * s["kv_heads"] * s["head_dim"]

    def weights(s):
        attention = s["hidden"] * s["head_dim"] * (2 * s["heads"] + 2 * s["kv_heads"])
        return s["layers"] * (attention + 3 * s["hidden"] * s["intermediate"])

    heavy, default = tiny_model.KV_HEAVY, tiny_model.SPEC
    assert kv_bytes(heavy) / weights(heavy) >= 4 * kv_bytes(default) / weights(default)
    assert kv_bytes(heavy) >= 4 * kv_bytes(default)
    assert tiny_model.cache_dir(heavy) != tiny_model.cache_dir(default)


def test_rates_keep_p_busy_the_share_asked():
    assert rates_for([0.8], 1000.0) == [0.8]
    assert rates_for([0.7, 0.9], 500.0) == [1.4, 1.8]


def test_churn_spreads_lengths_within_the_load_and_goes_round_the_pool(tmp_path):
    command = bench_serve_command("http://h:1", "tok", Load(float("inf"), 1100, 16, 24, max_concurrency=4,
                                                           range_ratio=0.8), tmp_path, "churn")
    assert command[command.index("--random-range-ratio") + 1] == "0.8"
    assert command[command.index("--max-concurrency") + 1] == "4"
    assert "--random-range-ratio" not in bench_serve_command("http://h:1", "tok", Load(1.0, 512, 32, 8), tmp_path, "x")
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 32, "num_key_value_heads": 1,
                                                      "head_dim": 64, "hidden_size": 64, "num_attention_heads": 1}))
    # 16 KiB per token in float32; 512 MiB hold 32,768 tokens; churn prompts average 1,126 tokens
    assert pool_churn_prompts(str(tmp_path), 512 << 20, 4, 2048) == 44
    assert pool_churn_prompts("Qwen/Qwen3-32B", 512 << 20, 2, 2048) == 8  # no config to read


def test_descriptors_per_transfer_counts_both_sides_posts_per_load_finished():
    def reading(descriptors, transfers):
        return ConnectorReading({}, {}, 0.0, descriptors, transfers)

    p = (reading(100, 4), reading(4196, 8))  # push: P posts
    d = (reading(0, 4), reading(0, 8))
    assert descriptors_per_transfer(p, d) == 1024.0
    assert descriptors_per_transfer((reading(0, 0), reading(0, 0)), (reading(10, 1), reading(10, 1))) is None


def test_goals_say_what_was_measured_against_what_was_asked():
    results = [result("monolithic", 100.0), result("vllm-pull", 400.0, 20.0), result("vllm-push", 300.0),
               result("push", 150.0, 12.0, breakdown_ms={"write": 5.0, "to_d_step": 30.0, "ttft": 150.0}),
               result("pull", 350.0, 12.0)]
    by_goal = {g["goal"]: g for g in evaluate(SEED.goals, results)}
    assert by_goal["push TTFT p50 <= 0.5x vllm-pull"] == {"goal": "push TTFT p50 <= 0.5x vllm-pull", "rate": 1.0,
                                                          "input_len": 512, "measured": 0.38, "bound": 0.5,
                                                          "met": True}
    assert by_goal["push TTFT p50 <= 0.9x vllm-push"]["met"] is True  # 0.5
    assert by_goal["push TPOT p50 <= 0.8x vllm-pull"]["met"] is True  # 0.6
    assert by_goal["pull TTFT p50 <= 0.8x vllm-pull"]["met"] is False  # 0.88
    light = {g["goal"]: g for g in evaluate(LIGHT.goals, results)}
    tax = next(g for text, g in light.items() if text.startswith("push TTFT p50 - monolithic's"))
    assert (tax["measured"], tax["bound"], tax["met"]) == (20.0, 18.0, False)  # 150-100-30 against 12+5+1
    cpu = light["push: connector CPU per prefill engine step p99 <= 100 us"]
    assert cpu["met"] is None and cpu["measured"] is None  # not in these results: said, not guessed
    failed = evaluate(SEED.goals, [result("push", 150.0), result("vllm-pull", 0.0, error="did not start")])
    assert failed[0]["met"] is None


def test_a_run_under_a_preset_reports_its_goals_descriptors_and_p_busy():
    results = [result("push", 150.0, descriptors_per_transfer=4096.0, p_busy=0.8),
               result("vllm-pull", 400.0, p_busy=0.8)]
    header, *rows = report.table(results)
    assert "desc/transfer" in header and "P busy" in header
    assert rows[0][header.index("desc/transfer")] == "4096" and rows[1][header.index("desc/transfer")] == "-"
    assert "desc/transfer" not in report.table([result("push", 150.0)])[0]  # shown only where measured
    goals = evaluate(SEED.goals, results)
    md = report.markdown(results, {"preset": "seed", "goals": goals, "p_prefill_ms": {512: 1000.0},
                                   "p_busy": [0.8], "churn": True})
    assert "## Goals of `--preset seed`" in md and "| push TTFT p50 <= 0.5x vllm-pull | 1.0 | 512 | 0.38 | 0.50 | yes |" in md
    assert "P's prefill time alone (one request at a time, before any load): 1000 ms at 512 tokens" in md
    assert "NOT MET" in report.goals_text(goals, "seed") or "no data" in report.goals_text(goals, "seed")
    assert set(PRESETS) == {"seed", "seed-long", "light", "shift", "multiturn", "hot-prefix"}


def test_every_routed_mode_gets_its_ttft_split_at_ps_answer(tmp_path):
    """vLLM's connectors mark no timeline of ours, but the router marks P's answer in every mode: the
    bench reads the split from the router's file alone."""
    from neuron_disagg.bench.load import breakdown_between
    from neuron_disagg.timeline import Timeline, p_and_after

    router = Timeline(tmp_path, "router")
    for i, (answered, first) in enumerate([(1.0, 1.2), (1.1, 1.2), (1.5, 1.55)]):
        router.mark(f"r{i}#0", "router_arrived", 100.0 + i)
        router.mark(f"r{i}#0", "router_p_answered", 100.0 + i + answered)
        router.mark(f"r{i}#0", "router_first_byte", 100.0 + i + first)
    router.mark("late#0", "router_arrived", 200.0)  # another run's
    router.close()
    split = breakdown_between(str(tmp_path), 99.0, 150.0, p_and_after)
    assert split == {"until_p_answered": pytest.approx(1100.0), "after_p_answered": pytest.approx(100.0)}
    assert breakdown_between(str(tmp_path), 99.0, 150.0) is None  # no instance marks: no full breakdown
    md = report.markdown([result("vllm-pull", 1200.0, p_and_after_ms=split)], {})
    assert "| vllm-pull | 1.0 | 512 | 1100.0 | 100.0 | 1200 |" in md


# -- the shifting-load preset ------------------------------------------------------------------------
def test_late_binding_modes_are_push_routers_with_a_horizon_on_the_same_p_and_ds():
    args = cli.parse(["--modes", "push,push-bind-0,push-bind-250,pull,vllm-pull"])
    assert groups(args.modes) == [("push", "push-bind-0", "push-bind-250", "pull"), ("vllm-pull",)]
    assert (router_mode("push-bind-250"), router_args("push-bind-250")) == (
        "push", ("--bind-horizon-ms", "250", "--no-prefix-routing"))
    assert router_args("push") == ("--no-prefix-routing",) and router_mode("push-whole") == "push"
    for bad in ("push-bind-", "push-bind-soon", "pushbind-0"):
        with pytest.raises(SystemExit):
            cli.parse(["--modes", bad])


def test_the_shift_preset_runs_1p2d_with_heavy_tailed_outputs_and_a_stopped_d():
    args = cli.parse(["--preset", "shift"])
    assert (args.decodes, args.heavy_tail, args.stop_decode_s) == (2, True, SHIFT.stop_decode_s)
    assert {"push", "pull", "vllm-pull", "vllm-push"} < set(args.modes) and any(m.startswith("push-bind-") for m in args.modes)
    with pytest.raises(SystemExit):  # nowhere else to bind: a stopped D needs another
        cli.main(["--stop-decode-s", "3", "--decodes", "1"])


def test_heavy_tailed_outputs_are_mostly_short_with_a_long_tail_and_prompts_as_long_as_asked(tmp_path):
    AutoTokenizer = pytest.importorskip("transformers", reason="installed with vLLM by scripts/setup.sh").AutoTokenizer

    model = str(tiny_model.build())
    path = heavy_tailed_dataset(model, 256, 512, 400, tmp_path / "d.jsonl", seed=3)
    rows = [json.loads(line) for line in open(path)]
    outputs = sorted(r["output_tokens"] for r in rows)
    assert len(rows) == 400 and outputs[0] >= 8 and outputs[-1] <= 512
    assert outputs[len(outputs) // 2] < 24 and outputs[-4] > 150  # median short, the top 1% long
    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = [len(tokenizer.encode(r["prompt"], add_special_tokens=False)) for r in rows[:20]]
    assert all(230 <= n <= 280 for n in lengths), lengths
    command = bench_serve_command("http://h:1", model, Load(1.0, 256, 512, 400, dataset=path), tmp_path, "x")
    assert command[command.index("--dataset-name") + 1] == "custom" and "--random-input-len" not in command
    assert command[command.index("--custom-output-len") + 1] == "-1"  # each row's own length


def test_the_bench_reads_the_decode_balance_and_the_legs_per_d_from_the_routers_metrics():
    from prometheus_client import generate_latest

    from neuron_disagg.router.metrics import RouterMetrics

    metrics = RouterMetrics()
    before = parse_router(generate_latest(metrics.registry).decode(), "push")
    for value in (1.0, 2.0, 3.0):
        metrics.decode_imbalance.labels("push").observe(value)
    metrics.decode_imbalance.labels("pull").observe(9.0)  # another mode's
    metrics.decode_legs.labels("http://127.0.0.1:8101").inc(3)
    after = parse_router(generate_latest(metrics.registry).decode(), "push")
    assert mean_imbalance(before, after) == 2.0
    assert after.decode_legs == {"http://127.0.0.1:8101": 3.0}
    assert mean_imbalance(after, after) is None


def test_shift_goals_compare_late_binding_with_push_at_arrival_pull_and_its_own_undisturbed_run():
    late = "push-bind-0"
    results = [result("push", 300.0, p99=1000.0, tpot_p99_ms=50.0), result("pull", 320.0, p99=800.0, tpot_p99_ms=40.0),
               result(late, 300.0, p99=700.0, tpot_p99_ms=30.0),
               result(late + " +stop", 300.0, p99=1200.0, stopped_d_binds=0)]
    goals = {g["goal"]: g for g in evaluate(SHIFT.goals, results)}
    assert goals[f"{late} TTFT p99 <= 0.8x push"]["met"] is True  # 0.7
    assert goals[f"{late} TPOT p99 <= 1x pull"]["met"] is True  # 0.75
    assert goals[f"{late} +stop D legs bound to the stopped D <= 0"]["met"] is True  # 0 counts
    assert goals[f"{late} +stop TTFT p99 <= 1.5x {late}"]["met"] is False  # 1.71
    assert goals["push-bind-100 TTFT p99 <= 1x pull"]["met"] is None  # not run: said, not guessed
    header, *rows = report.table(results)
    assert rows[3][header.index("to stopped D")] == "0" and rows[0][header.index("TPOT p99 ms")] == "50.0"


# -- the multi-turn presets -----------------------------------------------------------------------
def test_each_cache_aware_mode_shares_its_load_only_modes_instances_and_has_them_to_itself():
    """The instances publish their KV events to one endpoint, which one router binds."""
    args = cli.parse(["--preset", "multiturn"])
    assert groups(args.modes) == [("push", "push-cache"), ("pull", "pull-cache"), ("mono2", "mono2-cache")]
    assert groups(["push", "pull", "push-cache"]) == [("push", "pull", "push-cache")]
    assert groups(["push-cache", "pull-cache"]) == [("push-cache",), ("pull-cache",)]
    server = ServerSettings("/models/tiny", block_size=32)
    assert router_args("pull-cache", server, "127.0.0.1:5570") == (
        "--kv-events-endpoint", "127.0.0.1:5570", "--tokenizer", "/models/tiny", "--block-size", "32")
    assert [router_mode(m) for m in ("push-cache", "pull-cache", "mono2", "mono2-cache")] == ["push", "pull", "push", "push"]
    assert (args.prompts, args.prefills, args.decodes, args.conversations) == (54, 2, 2, 9)


def test_each_turn_carries_the_previous_prompt_and_the_models_answer_and_waits_for_it():
    """``converse`` against a server that answers with token ids of its own: turn t + 1's prompt is
    turn t's, the ids it answered and a new message, sent only after that answer ended."""
    import asyncio

    from aiohttp import web

    from neuron_disagg.bench.conversations import Script, _converse
    from neuron_disagg.bench.conversations import Conversations

    seen: list[tuple[list[int], float, float, list[int]]] = []  # prompt, when asked, when answered, answer

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["return_token_ids"] and body["stream"]
        asked, answer = time.monotonic(), [9000 + 10 * len(seen) + i for i in range(body["max_tokens"])]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for token in answer:
            await asyncio.sleep(0.01)
            # a line separator inside the text, which JSON leaves as it is: not a line break in SSE
            chunk = json.dumps({"choices": [{"text": "x\u2028y", "token_ids": [token]}]}, ensure_ascii=False)
            await resp.write(f"data: {chunk}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        seen.append((body["prompt"], asked, time.monotonic(), answer))
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            plan = Script([1, 2, 3], [[[100 * c + t] for t in range(3)] for c in range(2)])
            return await _converse(url, plan, Conversations(2, 3, 3, 1, 3), rate=50.0, seed=3)
        finally:
            await runner.cleanup()

    turns = asyncio.run(main())
    assert len(turns) == 6 and all(t.ttft_s and t.tpot_s and len(t.answer) == 3 for t in turns)
    for c in range(2):
        mine = [entry for entry in seen if entry[0][3] == 100 * c]  # the conversation's first message
        assert len(mine) == 3 and mine[0][0] == [1, 2, 3, 100 * c]
        for (before, _, answered, answer), (after, asked, _, _) in zip(mine, mine[1:], strict=False):
            assert after[:len(before) + 3] == before + answer  # the model's own answer, in the prompt
            assert asked >= answered  # closed loop: sent once that answer had ended


def test_each_seed_scripts_conversations_that_share_nothing_with_another_seeds():
    pytest.importorskip("transformers", reason="installed with vLLM by scripts/setup.sh")
    from neuron_disagg.bench.conversations import script
    from neuron_disagg.bench.conversations import Conversations
    model = str(tiny_model.build())
    one, other = (script(model, Conversations(3, 2, 64, 16, 16), seed) for seed in (1, 2))
    assert len(one.users) == 3 and all(len(turns) == 2 for turns in one.users)
    assert len(one.system) == 64 and one.system[:8] != other.system[:8]
    assert script(model, Conversations(3, 2, 64, 16, 16), 1) == one  # and the same seed, the same script
