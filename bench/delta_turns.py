"""Delta-only turns (issue 35 §3): the proxy's CPU per turn to build a session's prompt
ids, full render vs delta, over a 35-turn agent session.

The conversation is bench/agent_session.py's (its preamble, task, shell outputs as
tool results, a fixed 24-token-ish answer per turn). Per turn, in this process, with
the default model's own tokenizer and chat template (what the embedded engine runs in
the proxy's process before vLLM sees the ids): **full**: render the chat template over
the whole conversation and tokenize it (what every turn did before); **delta**:
:class:`flowlift.local_engine.delta.DeltaPrompts` (the previous turn's ids plus the
new messages rendered and tokenized alone). CPU time (``time.process_time``), the
median of ``--reps`` runs per turn; the ids are checked equal on every turn.

    .venv/bin/python bench/delta_turns.py [--turns 35] [--reps 20]
    .venv/bin/python bench/delta_turns.py --smoke   # seconds: 3 turns, nothing saved
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agent_session import PREAMBLE, TASK, tool_result
from bench.harness import save
from flowlift.local_engine.delta import DeltaPrompts

ANSWER = "Next I will run the tests to see whether the limit option works when it is zero."


def tokenizer() -> Any:
    import transformers

    from flowlift.local_engine.vllm_engine import VLLMConfig

    return transformers.AutoTokenizer.from_pretrained(VLLMConfig.for_model(None).model)


def cpu_ms(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append((time.process_time() - t0) * 1000)
    return statistics.median(times)


def delta_turn(render: Any, encode: Any, prev: list[dict[str, Any]] | None,
               msgs: list[dict[str, Any]]) -> tuple[list[int], float]:
    """``msgs``' ids from a session whose previous turn sent ``prev``, and the CPU ms
    of that turn alone."""
    d = DeltaPrompts(render, encode)
    if prev is not None:
        d.ids("s", prev)
    t0 = time.process_time()
    ids = d.ids("s", msgs)
    return ids, (time.process_time() - t0) * 1000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--turns", type=int, default=35)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.turns, args.reps = 3, 2
    tok = tokenizer()

    def render(m: list[dict[str, Any]], gen: bool) -> str:
        return str(tok.apply_chat_template(m, add_generation_prompt=gen, tokenize=False))

    def encode(t: str) -> list[int]:
        return list(tok.encode(t, add_special_tokens=False))

    msgs: list[dict[str, Any]] = [{"role": "system", "content": f"Session x. {PREAMBLE}"},
                                  {"role": "user", "content": TASK}]
    rows = []
    for n in range(args.turns):
        ids, _ = delta_turn(render, encode, msgs[:-2] if n else None, msgs)
        assert ids == encode(render(msgs, True)), f"turn {n + 1}: delta ids differ"
        full_ms = cpu_ms(lambda m=msgs: encode(render(m, True)), args.reps)
        delta_ms = statistics.median(
            delta_turn(render, encode, msgs[:-2] if n else None, msgs)[1]
            for _ in range(args.reps))
        rows.append({"turn": n + 1, "prompt_tokens": len(ids), "full_ms": round(full_ms, 3),
                     "delta_ms": round(delta_ms, 3)})
        msgs = [*msgs, {"role": "assistant", "content": ANSWER},
                {"role": "user", "content": tool_result(n)}]
    last = rows[-1]
    out = {"command": "python bench/delta_turns.py " + " ".join(sys.argv[1:] if argv is None
                                                                else argv),
           "rows": rows, "last_turn": last,
           "total_full_ms": round(sum(r["full_ms"] for r in rows), 2),
           "total_delta_ms": round(sum(r["delta_ms"] for r in rows), 2),
           "machine": "2 CPU cores, shared with other helpers' work while measuring"}
    print(f"turn {last['turn']}: {last['prompt_tokens']} prompt tokens, full "
          f"{last['full_ms']} ms, delta {last['delta_ms']} ms CPU; whole session "
          f"{out['total_full_ms']} vs {out['total_delta_ms']} ms")
    save("delta_turns", out, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
