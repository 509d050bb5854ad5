import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import refine
import refine.exporters


class TinyMLP(nn.Module):                    # your model, as you train it
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def loss_fn(outputs, batch):                 # your loss: a mean over the batch rows
    return F.cross_entropy(outputs, batch["labels"])


def parallelize(model, mesh):                # your TP plan (each rank keeps its own chunk)
    return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()},
                              src_data_rank=None)


def example():                               # `refine export --module examples/own_training.py:example`
    torch.manual_seed(0)
    return {"model": TinyMLP(), "loss_fn": loss_fn, "parallelize": parallelize, "ranges": {"labels": 4},
            "batch": {"x": torch.randn(8, 16), "labels": torch.randint(0, 4, (8,))}}


if __name__ == "__main__":
    spec = example()
    steps = {"tp": {"parallelize": parallelize},                     # your TP plan, every rank the whole batch
             "ddp": {"data_parallel": "ddp"},                        # DistributedDataParallel
             "fsdp": {"data_parallel": "fsdp"},                      # FSDP2's fully_shard
             "ddp_accumulate": {"data_parallel": "ddp", "micro_batches": 2}}  # + gradient accumulation
    for name, how in steps.items():
        refine.exporters.export_train(spec["model"], loss_fn, spec["batch"], 2, f"out/own_{name}",
                                      ranges=spec["ranges"], check=True, **how)
        print(name, refine.verify(f"out/own_{name}").verdict)
