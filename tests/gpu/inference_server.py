#!/usr/bin/env python3
"""An inference server for benchmarks/inference_restore.py (device machine): its startup is what a real one pays.

    inference_server.py --weights DIR --port-file FILE [--warmup-n 16 --prompt-len 32]
    inference_server.py --make-weights DIR [--layers 36 --embd 1280 --heads 20 --vocab 50257]

Startup prints `PHASE <name> <seconds> at <seconds since process start>` for `python` (the interpreter's own
start), `imports` (torch, transformers), `weights` (from_pretrained of DIR's safetensors, fp16, straight to
cuda), `warmup` (generate() of the served size, so cuBLAS and the kernels are loaded), then listens on
127.0.0.1 (port chosen by the kernel, written to --port-file) and prints `SERVING <seconds since process start>`.

One request per connection: the line `GEN <prompt_id> <n>` is answered by `OK <prompt_id> <n token ids>`
(greedy, the prompt drawn from a generator seeded with prompt_id), or `ERR <why>`; `QUIT` ends the server.
Nothing is printed while serving: its stdout file keeps the size CRIU recorded at a dump (a restore refuses
a file whose size changed). --make-weights writes a GPT-2-shaped model with random weights from a fixed seed
(no hub is reachable) with save_pretrained, fp16 safetensors, once before the benchmark's runs.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Any

# the process's start (clock ticks since boot, /proc/self/stat field 22), so that the interpreter's own start
# is counted as a cold start pays it; a tick is 10 ms, so the times below may read up to 10 ms long
START_BOOT = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
# no hub is reachable; a fixed cuBLAS workspace keeps the answers bit-equal between processes; should anything
# compile, it does so in this process, not in a worker pool that the dump would have to carry
for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "TORCHINDUCTOR_COMPILE_THREADS": "1"}.items():
    os.environ.setdefault(_k, _v)


def since_start() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME) - START_BOOT


class Phases:
    """Prints each startup phase's length and where it ended, as it ends."""

    def __init__(self) -> None:
        self.last = since_start()
        print(f"PHASE python {self.last:.3f} at {self.last:.3f}", flush=True)

    def done(self, name: str) -> None:
        now = since_start()
        print(f"PHASE {name} {now - self.last:.3f} at {now:.3f}", flush=True)
        self.last = now


def make_weights(a: argparse.Namespace) -> int:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    t = time.monotonic()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=a.layers, n_embd=a.embd, n_head=a.heads, vocab_size=a.vocab, n_positions=1024)
    with torch.device("cuda"):          # random init of ~800M parameters: seconds on the GPU, a minute on the CPU
        model = GPT2LMHeadModel(config)
    model.half().save_pretrained(a.make_weights, safe_serialization=True)
    size = sum(os.path.getsize(os.path.join(a.make_weights, f)) for f in os.listdir(a.make_weights))
    print(f"WEIGHTS {a.make_weights} params={sum(p.numel() for p in model.parameters())} bytes={size} "
          f"s={time.monotonic() - t:.2f}", flush=True)
    return 0


class GreedyModel:
    """The model and what one request runs: greedy decoding of exactly n tokens after a seeded prompt."""

    def __init__(self, torch: Any, model: Any, prompt_len: int) -> None:
        self.torch, self.model, self.prompt_len = torch, model, prompt_len

    def tokens(self, prompt_id: int, n: int) -> list[int]:
        torch = self.torch
        g = torch.Generator().manual_seed(prompt_id)
        ids = torch.randint(0, self.model.config.vocab_size, (1, self.prompt_len), generator=g).to("cuda")
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=n, min_new_tokens=n,
                                      pad_token_id=self.model.config.eos_token_id)
        return out[0, ids.shape[1]:].tolist()


def answer(gen: GreedyModel, line: str) -> tuple[str, bool]:
    """The reply to one request line, and whether the server goes on."""
    parts = line.split()
    if parts == ["QUIT"]:
        return "BYE", False
    try:
        if len(parts) != 3 or parts[0] != "GEN":
            raise ValueError("expected GEN <prompt_id> <n>")
        prompt_id, n = int(parts[1]), int(parts[2])
        if not 0 < n <= 1024 - gen.prompt_len:
            raise ValueError(f"n={n} outside 1..{1024 - gen.prompt_len}")
        return f"OK {prompt_id} " + " ".join(map(str, gen.tokens(prompt_id, n))), True
    except Exception as e:              # a bad request is answered, never ends the server
        return f"ERR {type(e).__name__}: {e}".replace("\n", " "), True


def read_line(conn: socket.socket, limit: int = 4096) -> str:
    buf = b""
    while b"\n" not in buf and len(buf) < limit:
        chunk = conn.recv(1024)
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace")


def serve(gen: GreedyModel, port_file: str) -> int:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:           # whole or absent: the client polls for this file
        f.write(f"{srv.getsockname()[1]}\n")
    os.rename(tmp, port_file)
    print(f"SERVING {since_start():.3f}", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                conn.settimeout(60)
                reply, more = answer(gen, read_line(conn))
                conn.sendall(reply.encode() + b"\n")
                # the client closes first: its side holds TIME_WAIT, and once it has, no socket of ours is left
                # but the listener (a dump then needs no --tcp-established)
                while conn.recv(1024):
                    pass
            except OSError:
                continue
        if not more:
            return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", help="directory written by --make-weights (config.json + model.safetensors)")
    ap.add_argument("--port-file", help="where the listening port is written, once listening")
    ap.add_argument("--warmup", type=int, default=3, help="generate() calls before serving")
    ap.add_argument("--warmup-n", type=int, default=16, help="tokens per warm-up call (the size to be served)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--make-weights", metavar="DIR", help="write the seeded random model to DIR and exit")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--embd", type=int, default=1280)
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=50257)
    a = ap.parse_args()
    if a.make_weights:
        return make_weights(a)
    if not (a.weights and a.port_file):
        ap.error("--weights and --port-file are needed to serve")
    phases = Phases()
    import torch
    from transformers import GPT2LMHeadModel    # the model's module too: transformers imports it lazily
    phases.done("imports")
    model = GPT2LMHeadModel.from_pretrained(a.weights, dtype=torch.float16, device_map="cuda")
    model.eval()
    torch.cuda.synchronize()
    phases.done("weights")
    gen = GreedyModel(torch, model, a.prompt_len)
    for i in range(a.warmup):
        gen.tokens(1_000_000 + i, a.warmup_n)     # prompt ids that requests are not expected to use
    torch.cuda.synchronize()
    phases.done("warmup")
    return serve(gen, a.port_file)


if __name__ == "__main__":
    sys.exit(main())
