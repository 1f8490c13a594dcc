"""Worker classes that run inside real clusters for tests (module-level: pickled by reference)."""

import torch

from psrpc.worker.data_parallel import Worker


def integer_grad(worker: int, step: int, numel: int) -> torch.Tensor:
    """A known integer-valued gradient for (worker, its step): exact in float32 sums."""
    idx = torch.arange(numel)
    return (((worker + 1) * (idx % 5) + step) % 7 - 3).to(torch.float32)


class IntegerGradWorker(Worker):
    """Pushes exactly ROUNDS known integer gradients through the real client, RPC and shards."""

    ROUNDS = 200

    @classmethod
    def build_model(cls, cfg, dataset):
        """Integer-valued initial weights, so that every sum below is exact in float32."""
        model = super().build_model(cfg, dataset)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.round(p * 10))
        return model

    def run(self, after_step=lambda *a: False) -> None:
        versions = self.load(self.client.pull())
        numels = self.flat.layout.shard_numel
        for s in range(self.ROUNDS):
            grads = [integer_grad(self.index, s, n) for n in numels]
            replies = self.client.push_pull(versions, grads, 0.0, 1)
            versions = self.load(replies)
            self.stats.pushes += 1
            self.stats.accepted += int(all(r.accepted for r in replies))
            after_step(replies[0], 0.0, 0.0)


class FailingWorker(Worker):
    """worker1 raises in the middle of training: a bug in a rank. (In async mode the global
    step a worker sees jumps by about W per push, hence >=.)"""

    def step(self, step: int, versions):
        if self.index == 1 and step >= 5:
            raise RuntimeError("worker1 hit a bug at step 5")
        return super().step(step, versions)


class SlowChiefWorker(Worker):
    """The chief takes far too long to build its model: the others must time out, not hang."""

    @classmethod
    def build_model(cls, cfg, dataset):
        import time

        time.sleep(60)
        return super().build_model(cfg, dataset)
