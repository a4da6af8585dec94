"""Signals delivered at exact points of a real ``latentforge`` process, for the interrupt tests.

``python interrupt_hooks.py SPEC ARGS...`` runs ``latentforge ARGS`` (the CLI's ``main``) after
installing the hooks of SPEC, and exits with its exit code. SPEC is a ``;``-separated list of

- ``step=K:SIG[,SIG...]``: during optimizer step K (1-based), in the forward pass of its first
  micro batch, this process sends itself the signals (so the step must still be finished);
- ``start:SIG``: just before the trainer's first step (after set-up);
- ``save=N:SIG[,SIG...]``: right after the N-th safetensors file of the process is written
  (in the middle of a checkpoint: before its state, meta and marker files);
- ``vae_step=K:SIG``: during step K of ``train-vae``;
- ``encode_batch=K:SIG``: before the K-th encoder batch of ``encode``;
- ``rank=R``: the hooks apply on rank R only (the ``RANK`` variable; default every rank).

The signals go through the kernel to the process's real handlers: what is tested is the
command's own signal handling, at a point chosen by the test instead of by a race.
"""

from __future__ import annotations

import os
import signal
import sys


def _send(names: str) -> None:
    for name in names.split(","):
        os.kill(os.getpid(), getattr(signal, name))


def install(spec: str) -> None:
    items = dict(item.split("=", 1) if "=" in item else item.split(":", 1) for item in spec.split(";") if item)
    rank = items.pop("rank", None)
    if rank is not None and os.environ.get("RANK", "0") != rank:
        return
    if "step" in items:
        from latentforge.train.trainer import Trainer

        k, names = items["step"].split(":")
        loss_on, sent = Trainer.loss_on, []

        def hooked_loss_on(self, batch, k=k, names=names):
            if self.step + 1 == int(k) and not sent:
                sent.append(True)
                _send(names)
            return loss_on(self, batch)

        Trainer.loss_on = hooked_loss_on
    if "start" in items:
        from latentforge.train.trainer import Trainer

        fit, names = Trainer.fit, items["start"]

        def hooked_fit(self, resume_from=None, names=names):
            _send(names)
            return fit(self, resume_from)

        Trainer.fit = hooked_fit
    if "save" in items:
        import safetensors.torch

        n, names = items["save"].split(":")
        save_file, count = safetensors.torch.save_file, [0]

        def hooked_save_file(*a, n=n, names=names, **kw):
            save_file(*a, **kw)
            count[0] += 1
            if count[0] == int(n):
                _send(names)

        safetensors.torch.save_file = hooked_save_file
    if "vae_step" in items:  # train-vae clips the gradients once per step, before the update
        import torch

        k, names = items["vae_step"].split(":")
        clip, calls = torch.nn.utils.clip_grad_norm_, [0]

        def hooked_clip(*a, k=k, names=names, **kw):
            calls[0] += 1
            if calls[0] == int(k):
                _send(names)
            return clip(*a, **kw)

        torch.nn.utils.clip_grad_norm_ = hooked_clip
    if "encode_batch" in items:
        import latentforge.data.encode as enc_mod

        k, names = items["encode_batch"].split(":")
        decode_batch, calls = enc_mod.decode_batch, [0]

        def hooked_decode_batch(*a, k=k, names=names, **kw):
            calls[0] += 1
            if calls[0] == int(k):
                _send(names)
            return decode_batch(*a, **kw)

        enc_mod.decode_batch = hooked_decode_batch


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    install(sys.argv[1])
    from latentforge.cli import main

    sys.exit(main(sys.argv[2:]))
