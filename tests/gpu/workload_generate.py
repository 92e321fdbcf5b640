#!/usr/bin/env python3
"""A Hugging Face generation loop: a GPT-2-shaped model (transformers, random weights from a fixed seed: no
hub is reachable) decoding greedily one token a step with its KV cache on the GPU. One line a token
("step K token T"), compared with an uninterrupted run."""
from __future__ import annotations

import argparse
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sleep", type=float, default=0.1)
    a = ap.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=6, n_head=8, n_embd=512, vocab_size=8192, n_positions=1024)
    model = GPT2LMHeadModel(config).cuda().eval()
    tokens = torch.tensor([[1, 2, 3]], device="cuda")
    past = None
    with torch.no_grad():
        for k in range(a.steps):
            out = model(input_ids=tokens if past is None else tokens[:, -1:], past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
            print(f"step {k} token {int(nxt)}", flush=True)
            time.sleep(a.sleep)
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
