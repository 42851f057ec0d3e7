"""Worker for tests/integration/test_rng.py: ``torchrun --nproc-per-node 2 tests/support/rng_worker.py CORPUS OUT``.

For DDP and FSDP, builds a :class:`Trainer` with dropout on each rank, records each rank's generator state
right after start-up, the full model state at start (under FSDP gathered from each rank's own shards), and
the embedding-dropout mask of the first training micro-batch; then trains one step. Rank 0 writes everything.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from reliability_runs import make_config
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from bigbatch.engine.rng import capture_rng_state
from bigbatch.parallel.distributed import distributed_session
from bigbatch.run.loop.trainer import Trainer


def main() -> None:
    corpus, out = Path(sys.argv[1]), Path(sys.argv[2])
    result: dict[str, object] = {}
    with distributed_session("cpu") as (dist_ctx, device):
        for parallel in ("ddp", "fsdp"):
            config = make_config(corpus, out / parallel, parallel=parallel, max_steps=1, eval_every=0)
            trainer = Trainer(config, dist_ctx, device)
            rng = capture_rng_state()
            whole = StateDictOptions(full_state_dict=True)  # FSDP2: every rank's shards gathered (a collective)
            full = get_model_state_dict(trainer.model, options=whole)
            model_state = {name: value.detach().clone() for name, value in full.items()}  # may alias parameters
            masks: list[torch.Tensor] = []

            def record(
                module: torch.nn.Module, inputs: object, output: torch.Tensor, masks: list[torch.Tensor] = masks
            ) -> None:
                if module.training and not masks:
                    masks.append((output == 0).clone())

            trainer.model.transformer.drop.register_forward_hook(record)  # type: ignore[union-attr]
            trainer.train()
            gathered = dist_ctx.all_gather_object({"rng": rng, "mask": masks[0]})
            result[parallel] = {"ranks": gathered, "model": model_state, "world": dist_ctx.world_size}
        if dist_ctx.is_main:
            torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main()
