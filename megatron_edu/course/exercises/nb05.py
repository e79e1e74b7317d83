"""Exercises of notebook 05: pipeline schedules run for real (2104.04473 §2.2).

05.1 ★★  a schedule that deadlocks: ``check_schedule`` must call it a deadlock, and the engine,
         run on that many ranks, must hang — the launcher stops it and says which ranks were stuck.
05.2 ★★★ the engine's message keys: what each action receives and sends
         (``messages_of(action, rank, stages)``), the stage map saying which virtual stage each
         chunk holds — checked on every action of several schedules, ZB-V's V included, then
         run in the engine (``run_schedule(..., RunSettings(messages=yours))``) on 2 ranks with the
         interleaved schedule.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from megatron_edu.course.exercises.checking import DEADLOCK_AFTER, Hint, exercise, on_ranks
from megatron_edu.grid import ParallelGrid
from megatron_edu.launch import RankError, run
from megatron_edu.model import GPT, GPTConfig
from megatron_edu.pipeline.engine import Batch, RunSettings, build_chunks, run_schedule
from megatron_edu.pipeline.schedules import (
    Action,
    Schedule,
    check_schedule,
    make_schedule,
    messages_of,
)
from megatron_edu.pipeline.stages import Message, StageMap

DEADLOCK_TIMEOUT = 5.0  # s: the backstop where the launcher cannot see the deadlock (not Linux)
MAX_RANKS, MAX_MICROBATCHES = 4, 4

CONFIG = GPTConfig(vocab_size=32, seq_len=8, num_layers=12, hidden=16, num_heads=2, dropout=0.0,
                   seed=0)


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m sequences (one per microbatch): token ids and next-token labels."""
    tokens = torch.randint(0, CONFIG.vocab_size, (m, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def _run_pipeline(schedule: Schedule, messages=messages_of) -> float:
    """One step of ``schedule`` on this rank, with the learner's ``messages`` if given."""
    grid = ParallelGrid(pp=dist.get_world_size())
    chunks = build_chunks(CONFIG, grid, schedule.stages)
    batch = Batch(*_batch(schedule.num_microbatches))
    return run_schedule(schedule, chunks, grid, batch, RunSettings(messages=messages)).loss.item()


# --- 05.1 ★★ a deadlock, predicted and seen ---------------------------------------------------

def _as_schedule(schedule) -> Schedule:
    if not isinstance(schedule, list | tuple) or not all(
            isinstance(row, list | tuple) and all(isinstance(a, Action) for a in row)
            for row in schedule):
        raise Hint(f"your function returned {type(schedule).__name__}; return one list of "
                   "Action per rank, e.g. [[Action('F', 0), …], [Action('F', 0), …]]")
    if not 2 <= len(schedule) <= MAX_RANKS:
        raise Hint(f"your schedule has {len(schedule)} ranks: a deadlock needs at least 2 ranks "
                   f"waiting on each other; keep it to {MAX_RANKS} or fewer")
    actions = [a for row in schedule for a in row]
    if any(a.chunk != 0 for a in actions):
        raise Hint("use one model chunk per rank (chunk 0): the real run builds one chunk per "
                   "rank")
    if not actions or max(a.microbatch for a in actions) >= MAX_MICROBATCHES:
        raise Hint(f"use microbatches 0 to {MAX_MICROBATCHES - 1} at most: a small deadlock is "
                   "the clearest")
    return Schedule(schedule, StageMap.plain(len(schedule)))


@exercise("05.1", "a schedule that deadlocks, predicted by check_schedule and seen for real",
          marks=(
              # a deadlock written out: rank 0 opens with F and B of one microbatch, rank 1
              # with the forward of another, which rank 0 sends only after that B
              r'\[\[Action\("F",(\d)\),Action\("B",\1\)(?:,Action\("[FB]",\d\))*\],'
              r'\[Action\("F",(?!\1)\d\)',
              r"rank0:F(\d)B\1(?:[FB]\d)*rank1:F(?!\1)\d",         # the same, as lists print
              # check_schedule's verdict on one: who waits where, for whom (one chunk per rank)
              r"deadlock:norankcanprogress;rank\dwaitsat[FB]\d+for[FB]\d+onrank\d;",
          ))
def _deadlock(fn) -> str:
    schedule = _as_schedule(fn())
    try:
        check_schedule(schedule)
    except ValueError as error:
        verdict = str(error)
    else:
        raise Hint("this schedule is valid — check_schedule finds that every rank reaches the end "
                   "of its list, so nothing would hang. Make two ranks wait on each other: e.g. "
                   "rank 0 waits for a backward that rank 1 can run only after a forward that "
                   "rank 0 has not sent yet")
    if verdict.startswith("incomplete"):
        raise Hint(f"{verdict}: incomplete rather than deadlocking — every rank must list F and B "
                   "of every microbatch exactly once; only the order may be wrong")
    if verdict.startswith("dependency"):
        raise Hint(f"{verdict} — a rank waiting on itself is an ordering error, refused before "
                   "anything runs; a deadlock is ranks waiting on each other")
    p = len(schedule)
    try:
        run(_run_pipeline, p, schedule, backend="gloo", timeout=DEADLOCK_TIMEOUT,
            deadlock_after=DEADLOCK_AFTER)
    except TimeoutError as err:  # a DeadlockError where the launcher saw the ranks blocked
        stuck = re.search(r"ranks (\[[\d, ]*\])", str(err))
        return (f"check_schedule predicted it — \"{verdict}\" — and run for real on {p} ranks, "
                f"the launcher stopped it: ranks {stuck.group(1) if stuck else '?'} did not "
                "finish, each blocked in a receive whose message its peer sends only after a "
                "receive of its own")
    except RankError as err:
        if "imed out" in str(err) or "imeout" in str(err):  # gloo's own timeout came first
            return (f"check_schedule predicted it — \"{verdict}\" — and run for real on {p} "
                    "ranks, the receives timed out: a deadlock")
        raise Hint(f"check_schedule predicted a deadlock, but the real run failed otherwise: "
                   f"{str(err).splitlines()[0]}") from None
    raise Hint(f"check_schedule says \"{verdict}\", yet the run finished: please report this "
               "schedule — the engine and the checker disagree")


# --- 05.2 ★★★ the message keys ------------------------------------------------------------------

MESSAGE_CASES = [("1f1b", 4, 1), ("1f1b", 2, 1), ("interleaved", 2, 2), ("interleaved", 4, 2),
                 ("interleaved", 3, 3), ("1f1b", 1, 1), ("zb-v", 3, 2)]


def _show(message) -> str:
    return "None" if message is None else (
        f"Message({message.kind!r}, {message.microbatch}, {message.stage})"
        if isinstance(message, Message) else repr(message))


def _explain(action: Action, rank: int, stages: StageMap, got, expected) -> str:
    """Why ``got`` is wrong for ``action``, in words."""
    stage, last = stages.stage(rank, action.chunk), stages.num_stages - 1
    where = f"{action} on rank {rank} ({stages}: virtual stage {stage})"
    (got_in, got_out), (in_, out) = got, expected
    if action.chunk and got == messages_of(Action(action.kind, action.microbatch), rank, stages):
        return (f"{where}: you return ({_show(got_in)}, {_show(got_out)}), the answer for chunk "
                f"0 — ask the stage map: stages.stage(rank, chunk) = {stage}, not {rank}")
    if stages.kind == "v" and got[0] != in_ and got[0] is not None and in_ is not None:
        return (f"{where}: you return ({_show(got_in)}, {_show(got_out)}), expected "
                f"({_show(in_)}, {_show(out)}) — under ZB-V's V the chunks do not sit at c·p + r: "
                "take the stage from stages.stage(rank, action.chunk)")
    if action.kind == "F" and stage == 0 and got_in is not None:
        return f"{where} reads the token ids: it receives nothing (None)"
    if action.kind == "F" and stage == last and got_out is not None:
        return (f"{where} is the last virtual stage: it computes the loss and sends nothing "
                "(None)")
    if action.kind == "B" and stage == last and got_in is not None:
        return f"{where} starts from its own loss: it receives no gradient (None)"
    if action.kind == "B" and stage == 0 and got_out is not None:
        return f"{where} took token ids as input: it has no gradient to send back (None)"
    for got_m, exp_m, what in ((got_in, in_, "receives"), (got_out, out, "sends")):
        if got_m == exp_m:
            continue
        if exp_m is None or not isinstance(got_m, Message):
            break
        if got_m.kind != exp_m.kind:
            return (f"{where} {what} {_show(got_m)}: a forward moves activations ('act'), a "
                    "backward gradients ('grad')")
        return (f"{where} {what} {_show(got_m)}, expected {_show(exp_m)}: a message is keyed by "
                "the virtual stage that receives it — an activation for i + 1 from F of i, a "
                "gradient for i − 1 from B of i")
    return f"{where}: you return ({_show(got_in)}, {_show(got_out)}), expected ({_show(in_)}, " \
           f"{_show(out)})"


def _messages_check(fn) -> int:
    count = 0
    for name, p, v in MESSAGE_CASES:
        schedule = make_schedule(name, p, 2 * p, v)
        for rank, row in enumerate(schedule):
            for action in row:
                got = fn(action, rank, schedule.stages)
                if not (isinstance(got, tuple) and len(got) == 2 and all(
                        m is None or isinstance(m, Message) for m in got)):
                    raise Hint(f"messages_of({action}, {rank}, {schedule.stages}) returned "
                               f"{got!r}; return a pair (what it receives, what it sends), each "
                               "a Message(kind, microbatch, stage) or None")
                expected = messages_of(action, rank, schedule.stages)
                if got != expected:
                    raise Hint(_explain(action, rank, schedule.stages, got, expected))
                count += 1
    return count


@exercise("05.2", "the engine's messages: what each action receives and sends",
          # no reference=: the solution's lines are messages_of's own, and the one line it adds
          # (if action.kind == "B":) is every schedule's vocabulary. What gives the answer away
          # is the rule at the two ends, in words:
          marks=(
              r"last(virtual)?stagecomputesthelossinsteadofsending",
              r"tokenidsonthefirst(virtual)?stage,otherwise",
              r"backpropagatefromtheloss\((the)?last(virtual)?stage\)",
              r"noneattheends",
              r"(first|0)(virtual)?stage(receives|takes|gets)nothing",
              r"last(virtual)?stage(sends|returns)nothing",
          ))
def _messages(fn) -> str:
    count = _messages_check(fn)
    m, p, v = 4, 2, 2
    schedule = make_schedule("interleaved", p, m, v)
    losses = on_ranks(p, _run_pipeline, schedule, fn, timeout=60.0)
    ids, labels = _batch(m)
    with torch.no_grad():
        serial = GPT(CONFIG)(ids, labels).item()
    if any(abs(loss - serial) > 1e-5 for loss in losses):
        raise Hint(f"every message matches, yet the run's loss {losses[0]:.6f} differs from the "
                   f"serial {serial:.6f}: please report this")
    return (f"right on all {count} actions of {len(MESSAGE_CASES)} schedules; the engine, run "
            f"with your function on {p} ranks (interleaved, v = {v}: activations and gradients "
            "both ways between the same two ranks), gives the serial model's loss")
