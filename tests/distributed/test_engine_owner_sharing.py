"""`faults.shared_by_owner`, what the ranks sharing one vLLM-Omni engine (the DiT engine's peers, the served BAGEL
engine's tp group) run every engine call through: on two gloo ranks, the owner's result reaches the other rank (or
only its success, `send=False`), the computation runs on the owner alone, and the owner's failure is raised on both
ranks: the owner's own exception, on the other rank the caller's `failure(died, kind, first line)`."""

from __future__ import annotations

from megatron_omni.parallel.rank_pool import run_ranks


def _share(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from megatron_omni.rollout.vllm_omni.faults import EngineWorkerDied, shared_by_owner

    group = dist.new_group(list(range(world_size)))
    calls: list[int] = []

    def compute() -> dict:
        calls.append(rank)
        return {"images": 4}

    def failure(died: bool, kind: str, message: str) -> Exception:
        return RuntimeError((died, kind, message))

    out = {"result": shared_by_owner(compute, 0, group, failure),
           "unsent": shared_by_owner(compute, 0, group, failure, send=False), "calls": calls, "raised": []}
    for error in (EngineWorkerDied("vLLM-Omni worker rank 0 died\nits traceback"), ValueError("bad request\nmore"),
                  KeyError()):
        def fail(error: Exception = error) -> None:
            raise error

        try:
            shared_by_owner(fail, 0, group, failure)
            out["raised"].append(None)
        except Exception as exc:  # noqa: BLE001 (the test compares which)
            out["raised"].append((type(exc).__name__, exc.args[0] if exc.args else None))
    return out


def test_the_owner_computes_and_its_result_or_failure_reaches_every_rank() -> None:
    owner, other = run_ranks(_share, 2, timeout_s=120)
    assert owner["calls"] == [0, 0] and other["calls"] == []
    assert owner["result"] == other["result"] == {"images": 4}
    assert owner["unsent"] == {"images": 4} and other["unsent"] is None
    assert owner["raised"] == [("EngineWorkerDied", "vLLM-Omni worker rank 0 died\nits traceback"),
                               ("ValueError", "bad request\nmore"), ("KeyError", None)]
    assert other["raised"] == [("RuntimeError", (True, "EngineWorkerDied", "vLLM-Omni worker rank 0 died")),
                               ("RuntimeError", (False, "ValueError", "bad request")),
                               ("RuntimeError", (False, "KeyError", ""))]
