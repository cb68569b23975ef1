"""Fine-tune a Hugging Face causal LM with LoRA (the `peft` library) through a Mobius pipeline.

The model is wrapped by `peft.get_peft_model` (rank-r adapters on every linear layer of the
blocks, the base frozen) and compiled as it is: `mobius_fx.compile(peft_model, ...)`, called
like the model with `attention_mask` and `labels`. The batches are docstrings of the Python
standard library (the corpus of examples/finetune_gpt.py; nothing is downloaded) of varying
length, right-padded to a multiple of 16 tokens, the padding masked out and its labels -100.
Every micro-batch gets the same row lengths (in another order), so the pipeline's loss (the
mean of the micro-batches' means) is eager's mean over the batch's tokens.

    python examples/finetune_hf.py                 # a config-built small Llama, byte tokens; under a minute
    python examples/finetune_hf.py --model gpt2    # GPT-2 and its tokenizer from your local HF cache

`--model NAME` loads a checkpoint and its tokenizer from the local Hugging Face cache only
(`local_files_only=True`); without it there, the run says so and falls back to a config-built
model (GPT-2 for a gpt2 name, else Llama; random weights, byte-level tokens). The base weights are fetched to the
(virtual) GPUs but never get a gradient: only the adapters' gradients are sent back.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, uninstalled

import mobius_fx  # noqa: E402
from corpus import load_text  # noqa: E402
from mobius_fx import Topology  # noqa: E402

BYTE_PAD = 0  # the NUL byte: never in the corpus, so byte-level batches pad with it


def _topology(spec: str, model_bytes: int) -> Topology:
    if spec.startswith("virtual:"):
        gpus = int(spec.split(":", 1)[1])
        # twice the model's weights per GPU (at least 64 MiB: the attention of a block's backward
        # recompute needs a few MiB); the plan's memory model is conservative, and Mobius
        # streams every stage in and out regardless
        return Topology.virtual(gpus=gpus, memory=max(2 * model_bytes, 64 * 2**20), root_complexes=2 if gpus > 2 else 1)
    return Topology.from_json(spec) if spec.endswith(".json") else Topology.preset(spec)


def load_model(name: str, cache_dir: str | None, positions: int):
    """(model, encode, pad id, description): the checkpoint `name` and its tokenizer from
    the local HF cache, else a config-built small model of its family with byte-level tokens."""
    import transformers

    if name != "tiny":
        try:
            tok = transformers.AutoTokenizer.from_pretrained(name, local_files_only=True, cache_dir=cache_dir)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                name, local_files_only=True, cache_dir=cache_dir, attn_implementation="eager")
        except Exception as e:  # not cached (OSError), or not a causal LM: nothing is downloaded
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
            why = ("is not in the local Hugging Face cache" + (f" ({cache_dir})" if cache_dir else "")
                   if isinstance(e, OSError) else f"cannot be loaded from the local cache ({reason})")
            print(f"{name} {why}; nothing is downloaded: using a config-built "
                  f"{'GPT-2' if 'gpt2' in name else 'Llama'}-style model with random weights and byte-level tokens "
                  f"instead")
        else:
            model.config.use_cache = False
            model.train()  # from_pretrained gives eval mode; the pipeline is traced in the mode it trains in
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            return (model, lambda text: tok(text)["input_ids"], pad,
                    f"{name} from the local HF cache, its tokenizer")
    # Random weights at HF's default scale (0.02) give a frozen head whose logits barely move
    # from uniform, whatever the adapters do; at 0.1 the adapters have something to steer.
    if "gpt2" in name:
        cfg = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256, n_positions=positions,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                      attn_implementation="eager", bos_token_id=None, eos_token_id=None,
                                      initializer_range=0.1)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=256, vocab_size=256,
                                       max_position_embeddings=positions, use_cache=False, attn_implementation="eager",
                                       bos_token_id=None, eos_token_id=None, pad_token_id=BYTE_PAD,
                                       initializer_range=0.1)
        model = transformers.LlamaForCausalLM(cfg)
    return (model, lambda text: list(text.encode("utf-8")), BYTE_PAD,
            f"config-built {type(model).__name__} (random weights), byte-level tokens")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny",
                    help="'tiny' (a config-built Llama), or a checkpoint in the local HF cache, e.g. gpt2")
    ap.add_argument("--cache-dir", help="the Hugging Face cache to look in (default: HF's)")
    ap.add_argument("--data", help="a UTF-8 text file (default: the standard library's docstrings)")
    ap.add_argument("--topology", default="virtual:4", help="virtual:N, a preset name, or a topology JSON file")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=64, help="the longest row, in tokens")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch's intra-op threads (default: 1 for the config-built model, "
                                                "whose ops are too small to split, and torch's own for a checkpoint)")
    args = ap.parse_args(argv)
    if args.batch % args.microbatches:
        ap.error(f"--batch {args.batch} must be a multiple of --microbatches {args.microbatches}")
    if args.max_len < 16:
        ap.error(f"--max-len {args.max_len}: rows are 16 tokens or longer")

    torch.manual_seed(args.seed)
    # rows are padded to a multiple of 16 tokens: a config-built model has positions for that
    base, encode, pad, what = load_model(args.model, args.cache_dir, -(-args.max_len // 16) * 16)
    threads = args.threads or (1 if what.startswith("config-built") else None)
    previous = torch.get_num_threads()
    if threads:  # on 2 busy cores, two threads on tiny tensors run several times slower than one
        torch.set_num_threads(threads)
    try:
        fine_tune(args, base, encode, pad, what)
    finally:
        torch.set_num_threads(previous)


def fine_tune(args: argparse.Namespace, base: torch.nn.Module, encode, pad: int, what: str) -> None:
    from peft import LoraConfig, get_peft_model

    rng = random.Random(args.seed)
    # adapters on every linear layer but the output head ("all-linear"; GPT-2's are Conv1D,
    # which store their weights transposed: fan_in_fan_out)
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                            target_modules="all-linear",
                                            fan_in_fan_out=base.config.model_type == "gpt2"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    adapter_bytes = sum(p.numel() * p.element_size() for p in trainable)
    print(f"model: {what}; {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{sum(p.numel() for p in trainable) / 1e3:.1f}K of them trainable (LoRA r={args.rank})")

    # documents: the corpus's paragraphs (docstrings), tokenized; the last 5% held out
    text = load_text(data=args.data)
    docs = [ids for ids in (encode(p) for p in text.split("\n\n") if p.strip()) if len(ids) >= 16]
    if len(docs) < 2:
        raise SystemExit("the text has fewer than two paragraphs (blank-line separated) of 16 tokens or more")
    split = max(1, len(docs) // 20)
    train_docs, val_docs = docs[:-split], docs[-split:]
    print(f"corpus: {len(text) / 1e3:.0f} KB of text ({'--data ' + args.data if args.data else 'stdlib docstrings'}), "
          f"{len(docs)} documents of 16+ tokens")
    rows = args.batch // args.microbatches  # rows per micro-batch

    def batch(src: list[list[int]], rnd: random.Random, longest: int | None = None):
        """input_ids, attention_mask, labels (batch, padded length): rows of varying length,
        right-padded to a multiple of 16; every micro-batch has the same row lengths."""
        top = min(args.max_len, max(map(len, src)))  # the rows are pieces of single documents
        lengths = [rnd.randint(16, top) for _ in range(rows)]
        if longest is not None:
            lengths[0] = min(longest, top)
        order = [lengths[:] for _ in range(args.microbatches)]
        for o in order[1:]:
            rnd.shuffle(o)
        width = -(-max(lengths) // 16) * 16
        ids = torch.full((args.batch, width), pad, dtype=torch.long)
        mask = torch.zeros(args.batch, width, dtype=torch.long)
        for r, n in enumerate(x for o in order for x in o):
            doc = rnd.choice(src)
            while len(doc) < n:
                doc = rnd.choice(src)
            start = rnd.randint(0, max(0, len(doc) - n))
            piece = doc[start:start + n]
            ids[r, :len(piece)] = torch.tensor(piece)
            mask[r, :len(piece)] = 1
        return ids, {"attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    # compiled for the longest batch: shorter ones run on the same graph (its sequence length is
    # symbolic) and within its plan
    ids, kwargs = batch(train_docs, random.Random(args.seed), longest=args.max_len)
    topo = _topology(args.topology, model_bytes)
    pipe = mobius_fx.compile(model, topo, example_inputs=(ids,), example_kwargs=kwargs,
                             microbatches=args.microbatches, verbose=False)
    print(pipe.plan)
    print()
    opt = torch.optim.AdamW(trainable, lr=args.lr)  # the adapters, CPU masters, plain torch.optim

    val_batches = [batch(val_docs, random.Random(10_000 + i)) for i in range(4)]

    @torch.no_grad()
    def val_loss() -> float:
        model.eval()  # eager, on the same (master) weights
        loss = sum(model(v, **kw).loss.item() for v, kw in val_batches) / len(val_batches)
        model.train()
        return loss

    first = val_loss()
    print(f"step 0: validation loss {first:.3f}")
    t0 = time.perf_counter()
    bar = tqdm(range(1, args.steps + 1), desc="fine-tuning", unit="step", dynamic_ncols=True, disable=None)
    lengths: set[int] = set()
    for step in bar:
        ids, kwargs = batch(train_docs, rng)
        lengths.add(ids.shape[1])
        loss = pipe(ids, **kwargs).loss  # HF's loss over the labels, streamed through the pipeline
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", len=ids.shape[1])
        if step % args.log_every == 0 or step == args.steps:
            tqdm.write(f"step {step}: train loss {loss.item():.3f} (batch {tuple(ids.shape)}), "
                       f"validation loss {val_loss():.3f}")
    elapsed = time.perf_counter() - t0
    last = val_loss()
    sent = sum(v["bytes"] for gpu in pipe.transfer_stats(last_step=True).values()
               for k, v in gpu.items() if k.startswith("gradient"))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert all(model.get_parameter(n).grad is None for n in frozen), "a frozen base weight got a gradient"
    print(f"padded lengths {sorted(lengths)} ran on {len(pipe.variants)} compiled variant(s); last step sent back "
          f"{sent / 1e3:.1f} KB of gradients (the adapters': {adapter_bytes / 1e3:.1f} KB), none for "
          f"{len(frozen)} frozen base tensors")
    print(f"validation loss {first:.3f} -> {last:.3f} ({(first - last) / first:.0%} lower) in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
