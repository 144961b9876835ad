"""`lmlab export-hf ckpt=PATH out=DIR`: a checkpoint lmlab-train wrote, as a Hugging Face folder.

    lmlab export-hf ckpt=outputs/runs/<date>/<time>/checkpoints/last.ckpt out=hf/my-model

`transformers` loads the folder with `LlamaForCausalLM.from_pretrained(DIR)` (config.json,
model.safetensors) and `AutoTokenizer.from_pretrained(DIR)` (GPT-2 vocab.json, merges.txt and
tokenizer_config.json: the same ids as lmlab's tokenizer). Only a model of Llama's parts exports
(rmsnorm, swiglu, rope, mha, prenorm, dense FFNs); any other part is one error naming it.
"""

from __future__ import annotations

from pathlib import Path

from lmlab.errors import ConfigError

USAGE = "usage: lmlab export-hf ckpt=PATH out=DIR"


def _arguments(argv: list[str]) -> dict[str, str]:
    args = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in ("ckpt", "out") or not value:
            raise ConfigError(f"unexpected argument '{arg}'; {USAGE}")
        args[key] = value
    if args.keys() != {"ckpt", "out"}:
        raise ConfigError(f"ckpt and out are both needed; {USAGE}")
    return args


def export(ckpt: str | Path, out: str | Path) -> Path:
    """Write the checkpoint's model and tokenizer into `out` as Hugging Face files; returns `out`."""
    from lmlab.hf import save_pretrained, to_hf_llama
    from lmlab.tokenizers.hf_files import save_hf_tokenizer
    from lmlab.training.checkpoints import load

    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"out={out} is a file; give a folder (new, or one to write the files into)")
    model, tokenizer, _ = load(ckpt)
    to_hf_llama(model)  # a model with non-Llama parts fails here, before anything is written
    tokenizer.to_bpe()  # and so does a tokenizer with no GPT-2 form
    save_pretrained(model, out, eos_token_id=tokenizer.eot_id)
    return save_hf_tokenizer(tokenizer, out, model.max_seq_len)


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    args = _arguments(argv)
    out = export(args["ckpt"], args["out"])
    print(f"wrote {out}\nload it with:\n  from transformers import AutoTokenizer, LlamaForCausalLM\n"
          f"  model = LlamaForCausalLM.from_pretrained('{out}')\n  tokenizer = AutoTokenizer.from_pretrained('{out}')")
    return 0
