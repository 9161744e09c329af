"""One rank of the two-process training test (tests/test_distributed.py), started by torchrun.

``python -m torch.distributed.run --nproc_per_node 2 ... tests/distributed_worker.py OUT RESULTS OPTIONS_JSON``
runs :func:`transformer_ext.training.train` with the options in OPTIONS_JSON (plus ``out_dir=OUT``)
and writes this rank's trained parameters to ``RESULTS/rank<R>.safetensors`` and its result
(losses, learning rates, steps, world size) to ``RESULTS/rank<R>.json``.
"""

import json
import logging
import os
import sys

import torch


def main(out_dir: str, results: str, options_json: str) -> int:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    from safetensors.torch import save_file

    from transformer_ext.training import TrainOptions, train

    result = train(TrainOptions(out_dir=out_dir, **json.loads(options_json)))
    state = {name: p.detach().cpu().contiguous() for name, p in result.model.named_parameters()}
    save_file(state, os.path.join(results, f"rank{rank}.safetensors"))
    with open(os.path.join(results, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(
            dict(
                losses=result.losses,
                learning_rates=result.learning_rates,
                step=result.step,
                first_step=result.first_step,
                world_size=result.world_size,
                history_steps=[h["step"] for h in result.history],
            ),
            f,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
