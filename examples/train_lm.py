"""Train a small byte-level language model built on GatedDeltaNet, on real offline text: the Python standard
library's own source files. Reports the validation loss next to the data's unigram entropy, saves a loss curve and
a JSON log, and ends by generating a continuation through the decode cache.

    python examples/train_lm.py                         # cpu-small: a few minutes on 2 CPU cores
    python examples/train_lm.py --preset gpu-100m       # ~100M parameters, bf16 autocast, reports tokens/s

Context parallelism: `--cp N` splits every sequence over N processes (gloo on the CPU, NCCL on GPUs, one GPU per
process), started by the script itself or by torchrun; `--check` then also trains one process from the same seed and
prints both loss curves:

    python examples/train_lm.py --cp 2 --steps 20 --check                       # 2 CPU processes
    torchrun --nproc_per_node 2 examples/train_lm.py --preset gpu-100m --cp 2   # 2 GPUs

Model: byte embedding; N blocks of  x + GatedDeltaNet(RMSNorm(x)),  x + SwiGLU(RMSNorm(x));  final RMSNorm; output
head tied to the embedding.
"""
import argparse
import datetime
import json
import math
import os
import sys
import sysconfig
import time

# Many small ops on a possibly shared CPU: idle OpenMP threads sleep instead of spinning (set before torch loads;
# spinning threads of an oversubscribed machine made a CPU step ~8x slower).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import gated_delta as gd  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None

PRESETS = {
    "cpu-small": dict(device="cpu", steps=300, batch_size=16, seq_len=128, d_model=128, n_layers=2, heads=2,
                      lr=4e-3, eval_every=100, eval_batches=8),
    "gpu-100m": dict(device="cuda", steps=3000, batch_size=16, seq_len=2048, d_model=768, n_layers=12, heads=6,
                     lr=1e-3, eval_every=250, eval_batches=16),
}


# ---------------------------------------------------------------- data

def load_stdlib_text(val_every=20):
    """The .py files of the standard library (site-packages excluded), concatenated in path order; every
    `val_every`-th file is held out for validation. Returns (train, val) uint8 tensors and the file count."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        paths += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    paths.sort()
    train, val = bytearray(), bytearray()
    for i, p in enumerate(paths):
        with open(p, "rb") as f:
            (val if i % val_every == val_every - 1 else train).extend(f.read() + b"\n")
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8), len(paths)


def unigram_entropy(data):
    """Entropy of the byte distribution, in bits per byte."""
    p = torch.bincount(data.long(), minlength=256).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log2()).sum())


def batch(data, batch_size, seq_len, gen, device):
    idx = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
    rows = torch.stack([data[i:i + seq_len + 1] for i in idx.tolist()]).long()
    return rows[:, :-1].to(device, non_blocking=True), rows[:, 1:].to(device, non_blocking=True)


# ---------------------------------------------------------------- model

class SwiGLU(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w_gate = nn.Linear(d, hidden, bias=False)
        self.w_up = nn.Linear(d, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, d, heads, layer_idx, cp_group=None):
        super().__init__()
        self.mixer_norm = gd.GatedRMSNorm(d, eps=1e-6)
        self.mixer = gd.GatedDeltaNet(d, heads, layer_idx=layer_idx, cp_group=cp_group)
        self.mlp_norm = gd.GatedRMSNorm(d, eps=1e-6)
        self.mlp = SwiGLU(d, 32 * math.ceil(8 * d / 3 / 32))

    def forward(self, x, cache=None, use_cache=False):
        h, cache = self.mixer(self.mixer_norm(x), cache=cache, use_cache=use_cache)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache


class ByteLM(nn.Module):
    def __init__(self, d_model, n_layers, heads, checkpoint=False, cp_group=None):
        super().__init__()
        self.embed = nn.Embedding(256, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, i, cp_group) for i in range(n_layers))
        self.norm = gd.GatedRMSNorm(d_model, eps=1e-6)
        self.checkpoint = checkpoint
        self.reset_parameters(n_layers)

    @torch.no_grad()
    def reset_parameters(self, n_layers):
        nn.init.normal_(self.embed.weight, std=0.02)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                # residual-branch outputs scaled down with depth (GPT-2 style)
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o_proj", "w_down")) else 0.02
                nn.init.normal_(m.weight, std=std)

    def forward(self, idx, caches=None, use_cache=False):
        x = self.embed(idx)
        new_caches = []
        for i, block in enumerate(self.blocks):
            cache = caches[i] if caches is not None else None
            if self.checkpoint and self.training and not use_cache:
                x, c = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x, c = block(x, cache=cache, use_cache=use_cache)
            new_caches.append(c)
        logits = F.linear(self.norm(x), self.embed.weight)  # tied output head
        return logits, (new_caches if use_cache else None)


def set_cp_group(model, group):
    """Every GatedDeltaNet of the model runs over `group` (None: the whole sequence in this process)."""
    for m in model.modules():
        if isinstance(m, gd.GatedDeltaNet):
            m.cp_group = group


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        skip = getattr(p, "_no_weight_decay", False) or p.dim() < 2 or "embed" in name
        (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def generate(model, prompt, n_new, temperature, gen, device, amp):
    """Prefill the prompt with use_cache, then sample one byte at a time through the layers' decode caches."""
    model.eval()
    idx = torch.tensor([list(prompt.encode())], device=device)
    out = []
    with amp():
        logits, caches = model(idx, use_cache=True)
        for _ in range(n_new):
            probs = torch.softmax(logits[0, -1].float() / temperature, -1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=gen).item()
            out.append(nxt)
            logits, caches = model(torch.tensor([[nxt]], device=device), caches=caches, use_cache=True)
    return prompt + bytes(out).decode("utf-8", errors="replace")


class CP:
    """This process's part of a context-parallel run (group None: one process holds every token). Rank r takes the
    r-th contiguous slice of the sequence dimension."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1

    def bounds(self, T):
        sizes = [T // self.world + (r < T % self.world) for r in range(self.world)]
        start = sum(sizes[:self.rank])
        return start, start + sizes[self.rank]

    def sum_(self, t):
        if self.group is not None:
            dist.all_reduce(t, group=self.group)
        return t

    def sum_grads(self, model):
        """Parameters are replicated, each rank's gradient is its tokens' share: sum them (one flat all-reduce)."""
        if self.group is None:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, group=self.group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def loss_of(model, x, y, cp, amp):
    """Mean cross-entropy over every token of the batch; with CP this rank's share (its tokens' sum / all tokens)."""
    start, end = cp.bounds(x.shape[1])
    with amp():
        logits, _ = model(x[:, start:end])
    ce = F.cross_entropy(logits.float().reshape(-1, 256), y[:, start:end].reshape(-1), reduction="sum")
    return ce / y.numel()


@torch.no_grad()
def evaluate(model, val_batches, amp, cp):
    model.eval()
    losses = [cp.sum_(loss_of(model, x, y, cp, amp)).item() for x, y in val_batches]
    model.train()
    return sum(losses) / len(losses)


class Progress:
    """tqdm when installed; else one line rewritten in place on a terminal, or a line every 5% in a log file."""

    def __init__(self, total):
        self.total, self.t_last = total, 0.0
        self.tty = sys.stdout.isatty()
        self.bar = tqdm(total=total, ncols=100) if tqdm else None
        self.every = max(1, total // 20)

    def update(self, step, **info):
        text = " ".join(f"{k} {v}" for k, v in info.items())
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(text)
        elif self.tty and (time.time() - self.t_last > 0.5 or step == self.total):
            self.t_last = time.time()
            print(f"\rstep {step}/{self.total} {text}    ", end="", flush=True)
        elif not self.tty and (step % self.every == 0 or step == self.total):
            print(f"step {step}/{self.total} {text}", flush=True)

    def write(self, msg):
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(("\r" if self.tty else "") + msg + (" " * 20 if self.tty else ""), flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            print()


def train(cfg, args, device, cp, verbose):
    """Train from the seed; returns the model and the log (every step's loss in log["loss_per_step"])."""
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    use_amp = device.type == "cuda"

    def amp():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_amp else torch.autocast("cpu", enabled=False)

    train_data, val, n_files = load_stdlib_text()
    h_bits = unigram_entropy(train_data)
    model = ByteLM(cfg["d_model"], cfg["n_layers"], cfg["heads"], checkpoint=args.checkpoint, cp_group=cp.group)
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if verbose:
        print(f"data: {n_files} stdlib .py files, train {train_data.numel() / 1e6:.1f} MB, val "
              f"{val.numel() / 1e6:.1f} MB; unigram entropy {h_bits:.3f} bits/byte = {h_bits * math.log(2):.3f} nats")
        print(f"model: {n_params / 1e6:.2f}M params, d_model {cfg['d_model']}, {cfg['n_layers']} layers, "
              f"{cfg['heads']} heads; batch {cfg['batch_size']} x {cfg['seq_len']} bytes, {cfg['steps']} steps, "
              f"lr {cfg['lr']}, {device.type}{' bf16 autocast' if use_amp else ''}"
              f"{', checkpointing' if args.checkpoint else ''}"
              f"{f', sequence split over {cp.world} processes' if cp.group is not None else ', one process'}")

    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=cfg["lr"], betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    warmup = max(1, cfg["steps"] // 20)

    def lr_at(step):  # linear warm-up, cosine decay to 10%
        if step < warmup:
            return cfg["lr"] * (step + 1) / warmup
        frac = (step - warmup) / max(1, cfg["steps"] - warmup)
        return cfg["lr"] * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))

    val_gen = torch.Generator().manual_seed(1234)
    val_batches = [batch(val, cfg["batch_size"], cfg["seq_len"], val_gen, device) for _ in range(cfg["eval_batches"])]
    log = {"config": {**cfg, "preset": args.preset, "checkpoint": args.checkpoint, "params": n_params,
                      "cp": cp.world},
           "unigram_entropy_bits": h_bits, "unigram_entropy_nats": h_bits * math.log(2), "train": [], "val": [],
           "loss_per_step": []}
    tokens_per_step = cfg["batch_size"] * cfg["seq_len"]
    progress = Progress(cfg["steps"]) if verbose else None
    t_start = time.time()
    t_window, tok_window, tok_s, loss_window = time.time(), 0, 0.0, []
    model.train()
    for step in range(1, cfg["steps"] + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1)
        x, y = batch(train_data, cfg["batch_size"], cfg["seq_len"], gen, device)
        loss = loss_of(model, x, y, cp, amp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        cp.sum_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tok_window += tokens_per_step
        loss_v = cp.sum_(loss.detach()).item()  # synchronises
        log["loss_per_step"].append(loss_v)
        loss_window.append(loss_v)
        if step % 10 == 0 or step == cfg["steps"]:
            now = time.time()
            tok_s = tok_window / (now - t_window)
            log["train"].append({"step": step, "loss": sum(loss_window) / len(loss_window), "tokens_per_s": tok_s})
            t_window, tok_window, loss_window = now, 0, []
        if progress:
            progress.update(step, loss=f"{loss_v:.3f}", **{"tok/s": f"{tok_s:,.0f}"})
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            t_eval = time.time()
            v = evaluate(model, val_batches, amp, cp)
            t_window += time.time() - t_eval  # tokens/s counts training time only
            log["val"].append({"step": step, "loss": v})
            if progress:
                progress.write(f"step {step}: val loss {v:.3f} nats ({v / math.log(2):.3f} bits/byte)")
    if progress:
        progress.close()
    elapsed = time.time() - t_start
    train_tok_s = [r["tokens_per_s"] for r in log["train"][len(log["train"]) // 2:]]
    log.update(final_val_loss=log["val"][-1]["loss"], elapsed_s=elapsed,
               tokens_per_s=sum(train_tok_s) / len(train_tok_s))
    return model, log, amp


def report(model, log, amp, args, device):
    h_bits, final, elapsed = log["unigram_entropy_bits"], log["final_val_loss"], log["elapsed_s"]
    print(f"final val loss {final:.3f} nats = {final / math.log(2):.3f} bits/byte  vs  unigram entropy "
          f"{h_bits * math.log(2):.3f} nats = {h_bits:.3f} bits/byte; {elapsed:.0f} s, "
          f"{log['tokens_per_s']:,.0f} tokens/s")

    set_cp_group(model, None)  # decoding runs in one process (the cache is not split)
    sample = generate(model, "def ", 240, 0.8, torch.Generator().manual_seed(args.seed), device, amp)
    log["sample"] = sample
    print("sample (decode cache):\n" + sample)

    n_params, cp = log["config"]["params"], log["config"]["cp"]
    name = f"train_lm_{args.preset}" + (f"_cp{cp}" if cp > 1 else "")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(log, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["step"] for r in log["train"]], [r["loss"] for r in log["train"]], label="train")
        ax.plot([r["step"] for r in log["val"]], [r["loss"] for r in log["val"]], "o-", label="validation")
        ax.axhline(h_bits * math.log(2), color="gray", ls="--", label="unigram entropy")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/byte)")
        ax.set_title(f"GatedDeltaNet byte LM, {n_params / 1e6:.1f}M params" + (f", CP over {cp}" if cp > 1 else ""))
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"{name}.png"), dpi=120)
        print(f"saved {args.out}/{name}.png and .json")
    except ImportError:
        print(f"saved {args.out}/{name}.json (matplotlib not installed: no plot)")


def compare(log_cp, log_one):
    """Print both loss curves and their largest difference."""
    a, b = log_cp["loss_per_step"], log_one["loss_per_step"]
    every = max(1, len(a) // 20)
    print(f"\n{'step':>6} {'loss, CP over ' + str(log_cp['config']['cp']):>18} {'loss, one process':>18} {'diff':>10}")
    for i in range(0, len(a), every):
        print(f"{i + 1:>6} {a[i]:>18.6f} {b[i]:>18.6f} {a[i] - b[i]:>10.2e}")
    worst = max(abs(x - y) for x, y in zip(a, b))
    print(f"largest |difference| over {len(a)} steps: {worst:.2e} (train), "
          f"{abs(log_cp['final_val_loss'] - log_one['final_val_loss']):.2e} (final validation loss)")


def run(rank, args, cfg, port):
    """One process: alone, or rank `rank` of a CP group of args.cp processes (spawned here when port is set,
    else started by torchrun)."""
    device = torch.device(cfg["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but no CUDA device is available")
    cp = CP()
    if args.cp > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        if port is not None:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(args.cp))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=args.timeout))
        if dist.get_world_size() != args.cp:
            raise SystemExit(f"--cp {args.cp} needs {args.cp} processes, torchrun started {dist.get_world_size()}")
        cp = CP(dist.group.WORLD)
    model, log, amp = train(cfg, args, device, cp, verbose=cp.rank == 0)
    if cp.group is not None:
        dist.destroy_process_group()  # what follows runs on rank 0 alone
    if cp.rank == 0:
        report(model, log, amp, args, device)
        if args.check:
            print("\n--check: the same training in one process, from the same seed")
            _, log_one, _ = train(cfg, args, device, CP(), verbose=False)
            compare(log, log_one)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    for name, typ in (("device", str), ("steps", int), ("batch-size", int), ("seq-len", int), ("d-model", int),
                      ("n-layers", int), ("heads", int), ("lr", float), ("eval-every", int)):
        ap.add_argument(f"--{name}", type=typ, default=None, help="overrides the preset")
    ap.add_argument("--checkpoint", action="store_true", help="activation checkpointing per block (GPU)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cp", type=int, default=1, help="split each sequence over this many processes (one GPU each "
                    "on CUDA); started here unless run under torchrun")
    ap.add_argument("--check", action="store_true", help="with --cp: also train in one process from the same seed "
                    "and print both loss curves")
    ap.add_argument("--timeout", type=float, default=600, help="timeout of the collectives, seconds")
    args = ap.parse_args()
    cfg = dict(PRESETS[args.preset])
    for k in ("device", "steps", "batch_size", "seq_len", "d_model", "n_layers", "heads", "lr", "eval_every"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    if args.cp < 1:
        raise SystemExit(f"--cp must be >= 1, got {args.cp}")
    if args.cp > 1 and "RANK" not in os.environ:  # not under torchrun: start the processes here
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(run, args=(args, cfg, port), nprocs=args.cp, join=True)
    else:
        run(int(os.environ.get("RANK", 0)), args, cfg, None)


if __name__ == "__main__":
    main()
