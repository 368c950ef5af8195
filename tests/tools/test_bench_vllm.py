"""tools/bench vllm's fixed-rate multi-round QA: LMCache's arrival schedule and the TTFT it counts,
driven through a fake engine on a fake clock (no vLLM); and its argument checks."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from tools.bench import vllm as bench


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


class _FakeLLM:
    """``LLM.enqueue`` + ``llm_engine.step`` as vLLM's offline engine offers them: every step
    takes ``step_s`` of the clock and serves every request in flight; a request has its first
    token after one step and is finished after two. Half of each prompt counts as cached."""

    def __init__(self, clock: _Clock, step_s: float) -> None:
        self.clock, self.step_s = clock, step_s
        self.llm_engine = self
        self.prompts: list[list[int]] = []
        self._live: dict[str, dict[str, Any]] = {}

    def enqueue(self, prompts: list[list[int]], params: int, use_tqdm: bool) -> list[str]:
        assert not use_tqdm
        (prompt,) = prompts
        rid = str(len(self.prompts))
        self.prompts.append(prompt)
        self._live[rid] = {"prompt": prompt, "answer": params, "arrival": self.clock.t, "steps": 0, "first": 0.0}
        return [f"{rid}-0a1b2c3d"]  # vLLM's internal id: the caller's plus 8 random characters

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def get_num_unfinished_requests(self) -> int:
        return len(self._live)

    def step(self) -> list[SimpleNamespace]:
        self.clock.t += self.step_s
        outs = []
        for rid, r in list(self._live.items()):
            r["steps"] += 1
            if r["steps"] == 1:
                r["first"] = self.clock.t - r["arrival"]
            else:
                del self._live[rid]
                outs.append(SimpleNamespace(
                    request_id=rid, finished=True, metrics=SimpleNamespace(first_token_latency=r["first"]),
                    num_cached_tokens=len(r["prompt"]) // 2, outputs=[SimpleNamespace(token_ids=[9] * r["answer"])]))
        return outs


def _mrq(users: int, rounds: int) -> dict[str, Any]:
    return {"system": [1, 1], "history": [[10 + u] * 2 for u in range(users)],
            "questions": [[[100 * (r + 1) + u] for u in range(users)] for r in range(rounds)], "answer": 2}


def _run(qps: float, step_s: float, users: int = 2, rounds: int = 2) -> tuple[dict[str, Any], _FakeLLM, _Clock]:
    clock = _Clock()
    llm = _FakeLLM(clock, step_s)
    out = bench._qps(llm, _mrq(users, rounds), qps, cpu=clock, clock=clock, sleep=clock.sleep,
                     request=lambda prompt, n: (prompt, n))
    return out, llm, clock


def test_requests_overlap_and_ttft_counts_from_the_scheduled_arrival() -> None:
    # qps 1: user 1 joins at 1 s, each user's next turn 2 s after its last; a request takes
    # two 1.25 s steps, so user 1 (due at 1 s) is added after the step that ends at 1.25 s
    # and waits 0.25 s for it, and user 0's second turn (due at 2 s) waits for its answer (2.5 s).
    out, llm, clock = _run(qps=1.0, step_s=1.25)
    assert out["arrivals_s"] == [0.0, 1.0, 2.5, 3.75]
    assert out["ttft_ms"] == pytest.approx([1250.0, 1500.0, 1250.0, 1250.0])
    assert out["in_flight_max"] == 2 and out["requests"] == 4
    assert out["in_flight_mean"] == pytest.approx(8 / 5)  # 1, 2, 2, 2, 1 requests per step
    assert clock.sleeps == []  # never idle
    assert out["wall_s"] == pytest.approx(6.25)


def test_idle_engine_sleeps_until_the_next_arrival_and_histories_grow() -> None:
    # qps 0.5: users join at 0 and 2 s, next turns 4 s later; each request is done in 1 s.
    out, llm, clock = _run(qps=0.5, step_s=0.5)
    assert out["arrivals_s"] == [0.0, 2.0, 4.0, 6.0]
    assert clock.sleeps == pytest.approx([1.0, 1.0, 1.0])
    assert out["ttft_ms"] == pytest.approx([500.0] * 4)
    # user 0's second turn: its first prompt, the answer, the next question
    assert llm.prompts[2] == [1, 1, 10, 10, 100, 9, 9, 200]
    lengths = [len(p) for p in llm.prompts]
    assert out["tokens"] == sum(lengths)
    assert out["hit_rate"] == pytest.approx(sum(n // 2 for n in lengths) / sum(lengths))
    assert out["cpu_ms_per_request"] == pytest.approx(out["wall_s"] * 1e3 / 4)  # the fake CPU is the clock


def test_a_request_never_finished_is_an_error_not_a_hang() -> None:
    clock = _Clock()
    llm = _FakeLLM(clock, 1.0)
    llm.step = lambda: []  # type: ignore[method-assign]  # vLLM drops every request
    llm.has_unfinished_requests = lambda: False  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="never finished"):
        bench._qps(llm, _mrq(1, 1), 1.0, cpu=clock, clock=clock, sleep=clock.sleep,
                   request=lambda prompt, n: (prompt, n))


@pytest.mark.parametrize(("kw", "message"), [
    ({"tp": 3}, "--tp must be 1 or 2"),
    ({"tp": 2, "workload": "qps"}, "long-document QA only"),
    ({"qps": -1.0, "workload": "qps"}, "request rate > 0"),
    ({"workload": "nope"}, "--workload must be one of"),
])
def test_bad_options_say_what_to_pass(kw: dict[str, Any], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(**{"workload": "standard", "tp": 1, "qps": 0.0, **kw})
    with pytest.raises(SystemExit) as e:
        bench._options(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_default_options() -> None:
    assert bench._options(argparse.Namespace(workload="standard", tp=1, qps=0.0)) == ("standard", 1, bench.QPS)


def test_overhead_lockstep_alternates_who_goes_first_and_pairs_each_prompt() -> None:
    from tools.bench import vllm_overhead as ov

    calls: list[tuple[str, str, int]] = []
    flushed: list[str] = []

    def ask(e: str, phase: str, i: int) -> dict[str, float]:
        calls.append((e, phase, i))
        # kvstore costs 10% more on prompt 0 of each phase, the same on the others
        base = 10.0 + i
        return {"ms": base * (1.1 if e == "kvstore" and i == 0 else 1.0), "cpu_ms": base, "cached": 0 if phase == "miss" else 32}

    def flush(e: str) -> float:
        flushed.append(e)
        return 0.5 if e == "kvstore" else 0.0

    phases: list[str] = []
    res = ov.lockstep(ask, flush, prompts=3, after=phases.append)
    assert phases == ["start", "miss", "hit"]
    assert [c[0] for c in calls[:6]] == ["vllm", "kvstore", "kvstore", "vllm", "vllm", "kvstore"]
    assert [c[1] for c in calls] == ["miss"] * 6 + ["hit"] * 6
    assert sorted(flushed) == ["kvstore", "vllm"]  # once each, after the miss phase only
    rows = {r["metric"]: r for r in ov.rows(res, {"prompts": 3}, lookups={"miss": 3, "hit": 0})}
    wall = rows["overhead_hit_ms_median_kvstore"]
    assert wall["paired_ratio"] == 1.0 and wall["paired_iqr"][1] > 1.0  # one of three 10% dearer
    assert wall["cached_tokens"] == wall["baseline_cached_tokens"] == 96 and wall["daemon_lookups"] == 0
    assert rows["overhead_miss_cpu_median_kvstore"]["ratio"] == 1.0
    assert rows["overhead_flush_cpu_kvstore"]["value"] == 0.5


def test_overhead_hook_timer_counts_the_outermost_call_once() -> None:
    from tools.bench import vllm_overhead as ov

    class Conn:
        def get_finished(self, ids: set[str]) -> int:
            return len(ids)

        def get_transfer_results(self, ids: set[str]) -> int:
            return self.get_finished(ids) + 1  # a hook calling another: counted under the outer one

    spent = ov.time_hooks(Conn)
    c = Conn()
    assert c.get_transfer_results({"a", "b"}) == 3 and c.get_finished({"a"}) == 1
    assert spent["get_transfer_results"] > 0 and spent["get_finished"] > 0
    assert set(spent) == set(ov.HOOKS) and spent["start_load_kv"] == 0.0
    assert ov._hooks_row({"a": 0.25, "b": 0.0})["total"] == 0.25
