"""A training run for the SIGKILL test (tests/test_trainer_resume.py): run as a script, resumed if it can be.

argv: CHECKPOINT_DIR OUT_FILE [KILL_IN_WRITE]. Prints "step N" after every optimizer step. With
KILL_IN_WRITE=K the process SIGKILLs itself half way through writing the bytes of its K-th checkpoint.
"""

import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import edgetrain
import edgetrain.checkpoint as ck
from edgetrain.trainer import Callback

sys.path.insert(0, os.path.dirname(__file__))
from _models import mlp  # noqa: E402

torch.set_num_threads(1)
ck_dir, out = sys.argv[1], sys.argv[2]
kill_in_write = int(sys.argv[3]) if len(sys.argv) > 3 else 0

if kill_in_write:
    real_save = torch.save
    writes = [0]

    def save(obj, f, *a, **k):  # the bytes of checkpoint K reach the file half-way, then the process dies
        writes[0] += 1
        if writes[0] < kill_in_write:
            return real_save(obj, f, *a, **k)
        import io
        buf = io.BytesIO()
        real_save(obj, buf, *a, **k)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    ck.torch.save = save  # checkpoint.py's torch.save call goes through here (same module object)


class Print(Callback):
    def on_step_end(self, trainer, logs):
        print(f"step {logs['step']}", flush=True)
        time.sleep(0.01)  # a few ms a step, so that a kill at a random time lands anywhere in an epoch


torch.manual_seed(0)
model = mlp(dropout=0.3)
g = torch.Generator().manual_seed(1)
ds = TensorDataset(torch.randn(56, 16, generator=g), torch.randint(0, 5, (56,), generator=g))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
trainer = edgetrain.Trainer(model, opt, nn.CrossEntropyLoss(), DataLoader(ds, batch_size=8, shuffle=True),
                            scheduler=sched, scheduler_interval="step", grad_clip_norm=1.0, callbacks=[Print()],
                            checkpoint_dir=ck_dir, checkpoint_every_steps=3, keep_checkpoints=2, resume=True,
                            progress=False, prepare_options={"micro_batch_size": 3})
trainer.fit(3)
torch.save({k: v for k, v in model.state_dict().items()}, out)
print("done", flush=True)
