"""`lmlab generate ckpt=PATH prompt=TEXT [KEY=VALUE ...]`: text from a checkpoint, streamed as it is generated.

    lmlab generate ckpt=outputs/runs/<date>/<time>/checkpoints/last.ckpt prompt="def f(x):" max_new_tokens=200
    lmlab generate ckpt=... prompt="..." sampler=top_p sampler.p=0.9 sampler.temperature=0.8 sampler.seed=0
    lmlab generate ckpt=... prompt_file=prompts.jsonl       # {"prompt": "..."} per line -> JSONL completions
    lmlab generate ckpt=... prompt="..." draft=small.ckpt draft_k=4   # speculative decoding with a draft model
    lmlab generate ckpt=... prompt="..." draft=mtp                    # the model's own MTP modules draft
    lmlab generate ckpt=... prompt="..." quant=int8                   # or quant=int4 (GPTQ, calibrated)
    lmlab generate ckpt=hf/my-model prompt="..."                      # a Hugging Face Llama folder

Overrides work as in lmlab-train and are checked the same way, except `prompt=`, whose text is taken
verbatim (commas, quotes and brackets need no Hydra quoting). One prompt streams its completion to
stdout; a prompt_file prints one JSON line per prompt ({"prompt", "completion", "finish_reason"}),
batch by batch. Generation stops at the tokenizer's end-of-text token, a `stop` string, or
max_new_tokens; a one-line summary of the speed goes to stderr.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from lmlab.catalog import load_catalog
from lmlab.cli.compose import compose_config
from lmlab.cli.listing import Section, format_section
from lmlab.data import SOURCES, load_or_build
from lmlab.data.batches import evenly_spaced_windows
from lmlab.errors import ConfigError
from lmlab.hf import from_hf_llama
from lmlab.inference.engine import Engine
from lmlab.inference.generate import Generation, GenerationError, prepare_prompts
from lmlab.inference.megakernel import QUANT_KERNEL
from lmlab.inference.quant import QUANTS, quantize
from lmlab.inference.samplers import SAMPLERS
from lmlab.inference.text_stream import TextStream
from lmlab.inference.speculative import check_draft, speculative_generate
from lmlab.jsonl import json_lines
from lmlab.nn.transformer import Transformer
from lmlab.registry import unknown_name_message
from lmlab.tokenizers import BPETokenizer
from lmlab.tokenizers.base import Tokenizer
from lmlab.training.checkpoints import CONFIG_KEY, checkpoint_tokenizer, load, model_weights, read_checkpoint

# GPTQ's calibration (the paper's): this many windows of the model's context, run this many at a time.
CALIBRATION_WINDOWS = 128
CALIBRATION_BATCH = 8
CUDA_KERNEL_FLAGS = ("megakernel", "folded_norms", "batch_invariant")  # settings that run Triton kernels on CUDA
UNQUANTIZED_FLAGS = ("folded_norms", "batch_invariant")  # those whose kernels read unquantized weights only


@dataclass
class GenerateConfig:
    ckpt: str | None = None  # an lmlab-train checkpoint, or a Hugging Face Llama folder (config.json, *.safetensors)
    prompt: str | None = None  # the text to continue, taken verbatim from the command line
    prompt_file: str | None = None  # JSONL: one {"prompt": "..."} object per line
    batch_size: int = 32  # prompts of a prompt_file generated together
    max_new_tokens: int = 128
    sampler: Any = MISSING
    stop: list[str] = field(default_factory=list)  # stop strings (\n, \t: newline, tab); end-of-text always stops
    truncate: bool = False  # keep a too-long prompt's last tokens instead of failing
    draft: str | None = None  # speculative decoding: a draft checkpoint or HF folder (same tokenizer), or mtp
    draft_k: int | None = None  # tokens drafted per step (default: 4 from a draft model, one per MTP module)
    quant: Any = None  # weight quantization of the model: int8 or int4 (lmlab list quant)
    calibration_file: str | None = None  # text for GPTQ's calibration (default: the checkpoint's training data)
    device: str = "auto"  # auto (cuda when there is one) | cpu | cuda
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16
    compile: bool = False  # torch.compile the decode step (a wait of up to a minute), replayed as a CUDA graph on CUDA
    cuda_graphs: bool | None = None  # replay the decode step from a CUDA graph; None: on CUDA (a fraction of a second)
    # One-token steps through every layer in one persistent Triton kernel (CUDA, plain Llama; the draft's too); with
    # quant=, the kernel reads the codes (int4 at batch 1), quantized in the layout it reads (quant.kernel=dequant)
    megakernel: bool = False
    # Decode steps with each RMSNorm folded into the kernels around it (CUDA, plain Llama, not quantized); default:
    # when compiled, at batches of 2 or more, where the model allows it.
    folded_norms: bool | None = None
    # Each token computed to the same bits whatever the step's shape (CUDA; eager steps in CUDA graphs): greedy
    # speculative decoding then gives exactly the target's tokens in bf16 too (lmlab.inference.batch_invariant).
    batch_invariant: bool = False
    # Batch-1 steps take the final RMSNorm and the head in one Triton kernel (lmlab.kernels.normed_head_triton);
    # None: on CUDA where the model allows it (an RMSNorm before a plain head without soft-capping).
    head_kernel: bool | None = None
    plugins: list[str] = field(default_factory=list)  # modules imported before the config is composed

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_new_tokens", "draft_k"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for flag in UNQUANTIZED_FLAGS:
            if getattr(self, flag) and self.quant is not None:
                raise ConfigError(f"{flag}=true reads unquantized weights; drop quant= or {flag}=true")
        if self.megakernel and self.quant is not None:
            kernel = QUANTS.resolve(self.quant)[1].kernel
            if kernel not in ("auto", QUANT_KERNEL):
                raise ConfigError(f"megakernel=true reads the codes as quant.kernel={QUANT_KERNEL} stores them; drop "
                                  f"quant.kernel={kernel}")
        if self.batch_invariant and (self.compile or self.megakernel or self.folded_norms):
            raise ConfigError("batch_invariant=true runs its own kernels in eager steps; drop compile=true, "
                              "megakernel=true and folded_norms=true")


ConfigStore.instance().store(name="generate_schema", node=GenerateConfig)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MTP_DRAFT = "mtp"  # draft=mtp: self-speculation with the model's multi-token-prediction modules
# Stop strings are Hydra strings, where a backslash is a plain character; these escapes make `stop=["\n\n"]` work.
ESCAPES = {"\\n": "\n", "\\t": "\t", "\\\\": "\\"}


# -- the command line ---------------------------------------------------------------------------
def parse_config(argv: list[str]) -> GenerateConfig:
    """The typed config of `argv`: `prompt=` verbatim, every other `KEY=VALUE` through Hydra's compose."""
    if stray := [a for a in argv if "=" not in a]:
        raise ConfigError(f"unexpected argument '{stray[0]}': arguments are KEY=VALUE (lmlab generate --help)")
    prompts = [a.partition("=")[2] for a in argv if a.startswith("prompt=")]
    composed = compose_config([a for a in argv if not a.startswith("prompt=")], config_name="generate")
    cfg: GenerateConfig = OmegaConf.to_object(composed)
    cfg.prompt = prompts[-1] if prompts else None
    cfg.stop = [re.sub(r"\\[nt\\]", lambda m: ESCAPES[m.group()], s) for s in cfg.stop]
    if cfg.ckpt is None:
        raise ConfigError("no model: pass ckpt=PATH (a checkpoint lmlab-train wrote, or a Hugging Face Llama folder)")
    if (cfg.prompt is None) == (cfg.prompt_file is None):
        both = ", not both" if cfg.prompt is not None else ""
        raise ConfigError(f"pass one of prompt=TEXT or prompt_file=PATH{both}")
    if cfg.prompt == "":
        raise ConfigError("prompt is empty: generation needs text to continue")
    return cfg


def read_prompts(cfg: GenerateConfig) -> list[str]:
    if cfg.prompt is not None:
        return [cfg.prompt]
    path = Path(cfg.prompt_file)
    if not path.is_file():
        raise ConfigError(f"prompt_file={path} is not a file")
    prompts = []
    for n, record in json_lines(path.read_text(encoding="utf-8"), f"prompt_file={path}",
                                'write one {"prompt": "..."} object per line'):
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f'prompt_file={path} line {n} has no "prompt" string (or an empty one); write one '
                              '{"prompt": "..."} object per line')
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"prompt_file={path} holds no prompts")
    return prompts


def device_and_dtype(cfg: GenerateConfig) -> tuple[torch.device, torch.dtype]:
    cuda = torch.cuda.is_available()
    devices = {"auto": "cuda" if cuda else "cpu", "cpu": "cpu", "cuda": "cuda"}
    if cfg.device not in devices:
        raise ConfigError(unknown_name_message("device", cfg.device, devices))
    if devices[cfg.device] == "cuda" and not cuda:
        raise ConfigError("device=cuda, but torch sees no CUDA device; use device=cpu (or auto)")
    device = torch.device(devices[cfg.device])
    dtypes = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, **DTYPES}
    if cfg.dtype not in dtypes:
        raise ConfigError(unknown_name_message("dtype", cfg.dtype, dtypes))
    return device, dtypes[cfg.dtype]


# -- the models -------------------------------------------------------------------------------
@dataclass
class ModelSource:
    """A checkpoint or Hugging Face folder, read as far as the checks need before its weights load."""

    setting: str  # "ckpt=PATH": names it in errors
    tokenizer: Tokenizer
    vocab_size: int  # rows of the model's embedding
    max_seq_len: int
    stop_ids: list[int]  # the end-of-text token(s)
    load: Callable[[], Transformer]  # float32 on the CPU, in eval mode
    corpus: Callable[[], tuple[np.ndarray, np.ndarray, int]] | None  # -> (training, validation ids, context length)


def open_model(path: str, key: str) -> ModelSource:
    """The lmlab checkpoint file, or Hugging Face Llama folder, at `path`, given as `key=path`."""
    folder = Path(path)
    if not folder.is_dir():
        return _lmlab_checkpoint(path, key)
    if (folder / "config.json").is_file():
        return _hf_folder(folder, key)
    last = folder / "checkpoints" / "last.ckpt"
    hint = f"; did you mean {key}={last}?" if last.is_file() else ""
    raise ConfigError(f"{key}={path} is a folder without config.json: neither a checkpoint file nor a Hugging Face "
                      f"model folder{hint}")


def _lmlab_checkpoint(path: str, key: str) -> ModelSource:
    checkpoint = read_checkpoint(path, key)  # memory-mapped: the weights are not read here
    config = OmegaConf.create(checkpoint[CONFIG_KEY])
    load_catalog(config.get("plugins") or [])  # a plugin's tokenizer class
    # A checkpoint older than saved tokenizers has its tokenizer rebuilt by `load`, weights and all.
    tokenizer = checkpoint_tokenizer(checkpoint, path) or load(path)[1]

    def corpus():
        tokens = load_or_build(SOURCES.build(config.data), tokenizer, config.cache_dir).tokens
        split = int(len(tokens) * (1 - config.data.val_fraction))  # as the DataModule splits
        return tokens[:split], tokens[split:], config.data.context_length

    return ModelSource(setting=f"{key}={path}", tokenizer=tokenizer,
                       vocab_size=model_weights(checkpoint)["embed_tokens.weight"].shape[0],
                       max_seq_len=config.model.max_seq_len,
                       stop_ids=[] if tokenizer.eot_id is None else [tokenizer.eot_id],
                       load=lambda: load(path)[0], corpus=corpus)


def _hf_folder(folder: Path, key: str) -> ModelSource:
    """A Llama folder: config.json, *.safetensors, and GPT-2 tokenizer files (what `lmlab export-hf` writes)."""
    try:
        from safetensors.torch import load_file  # an optional dependency
    except ImportError:
        raise ConfigError(f"{key}={folder}: reading a Hugging Face folder needs safetensors (pip install safetensors)"
                          ) from None
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ConfigError(f"{key}={folder} has config.json but no *.safetensors weights")
    if "vocab_size" not in config:
        raise ConfigError(f"{key}={folder}: its config.json has no vocab_size, so it is no Llama config")
    tokenizer = _hf_tokenizer(folder, key)
    eos = config.get("eos_token_id")  # an id, a list of ids, or null
    stop_ids = sorted({i for i in [*(eos if isinstance(eos, list) else [eos]), tokenizer.eot_id] if i is not None})

    def build() -> Transformer:
        return from_hf_llama(config, {k: v for shard in shards for k, v in load_file(shard).items()})

    # 2048: LlamaConfig's default, which lmlab.hf also takes where config.json has none.
    return ModelSource(setting=f"{key}={folder}", tokenizer=tokenizer, vocab_size=config["vocab_size"],
                       max_seq_len=config.get("max_position_embeddings", 2048), stop_ids=stop_ids, load=build,
                       corpus=None)


def _hf_tokenizer(folder: Path, key: str) -> BPETokenizer:
    """GPT-2 byte-level BPE files; the special tokens are those tokenizer_config.json lists."""
    if not ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()):
        raise ConfigError(f"{key}={folder} has no vocab.json and merges.txt: lmlab reads a Hugging Face folder's "
                          "tokenizer as GPT-2 byte-level BPE files (as `lmlab export-hf` writes them)")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    specials = [token["content"] for token in config.get("added_tokens_decoder", {}).values()]
    eos = config.get("eos_token")
    specials += [eos["content"] if isinstance(eos, dict) else eos] if eos else []
    return BPETokenizer.from_dir(folder, list(dict.fromkeys(specials)))


# -- quantization ---------------------------------------------------------------------------------
def calibration_source(cfg: GenerateConfig, source: ModelSource) -> Callable[[], list[torch.Tensor]] | None:
    """What GPTQ calibrates on, checked now: calibration_file, else the checkpoint's training data;
    None when the quant entry needs no calibration."""
    quant = QUANTS.build(cfg.quant)  # checks the entry's fields
    if not quant.method.calibrated:
        return None
    what = f"quant={cfg.quant.name} with quant.method={quant.cfg.method}"
    if cfg.calibration_file is not None:
        path = Path(cfg.calibration_file)
        if not path.is_file():
            raise ConfigError(f"calibration_file={path} is not a file")
        return lambda: calibration_batches(source.tokenizer.encode_array(path.read_text(encoding="utf-8")),
                                           source.max_seq_len, f"calibration_file={path}")
    if source.corpus is None:
        raise ConfigError(f"{what} calibrates on text, and {source.setting} names no training data: pass "
                          "calibration_file=PATH (plain text), or use quant.method=rtn")
    try:
        tokens, _, context = source.corpus()
    except ConfigError as err:
        raise ConfigError(f"{what} calibrates on {source.setting}'s training data, which cannot be read ({err}); "
                          "pass calibration_file=PATH (plain text), or use quant.method=rtn") from None
    return lambda: calibration_batches(tokens, context, f"{source.setting}'s training data")


def calibration_batches(tokens, context_length: int, what: str) -> list[torch.Tensor]:
    """Up to CALIBRATION_WINDOWS windows spread over `tokens`, in batches of CALIBRATION_BATCH."""
    if len(tokens) < 2:
        raise ConfigError(f"{what} has {len(tokens)} tokens, too few to calibrate on")
    windows, _ = evenly_spaced_windows(tokens, CALIBRATION_WINDOWS, min(context_length, len(tokens) - 1))
    return list(windows.split(CALIBRATION_BATCH))


# -- streaming ------------------------------------------------------------------------------------
class StreamPrinter:
    """Prints one sequence's text as its tokens arrive (lmlab.inference.text_stream holds back what may
    still change: a partial character, the start of a stop string)."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: list[int], stops: list[str], out=None):
        self.text = TextStream(tokenizer, stops)
        self.stop_ids = set(stop_ids)
        self.out = out or sys.stdout

    def __call__(self, new: list[int | None]) -> None:
        token = new[0]
        if token is not None and token not in self.stop_ids:
            self.write(self.text.push(token))

    def show(self, text: str) -> None:
        """Print the rest of the final text (all that was held back)."""
        self.write(self.text.finish(text))

    def write(self, delta: str) -> None:
        if delta:
            self.out.write(delta)
            self.out.flush()


def stats_line(generation: Generation) -> str:
    stats = generation.stats
    # the first token comes from the prefill: a generation that stopped there ran no decode step to time
    decode = ([f"{stats.tpot_s * 1e3:,.2f} ms/token", f"decode {stats.decode_tokens_per_s:,.0f} tokens/s"]
              if stats.steps else ["no decode step"])
    parts = [f"{stats.new_tokens} new token{'s' * (stats.new_tokens != 1)}", f"TTFT {stats.ttft_s * 1e3:,.1f} ms",
             f"prefill {stats.prefill_tokens_per_s:,.0f} tokens/s", *decode,
             f"KV cache {stats.kv_cache_bytes / 2**20:,.2f} MiB"]
    if "acceptance_rate" in generation.extra:
        parts.append(f"draft acceptance {generation.extra['acceptance_rate']:.0%}")
    return "lmlab generate: " + ", ".join(parts)


# -- the run --------------------------------------------------------------------------------------
def generate(cfg: GenerateConfig, out=None, err=None) -> None:
    """Everything `lmlab generate` does after parsing: checks, loading, generation, printing."""
    out, err = out or sys.stdout, err or sys.stderr
    sampler = SAMPLERS.build(cfg.sampler)  # checks temperature, p, ...
    device, dtype = device_and_dtype(cfg)
    for flag in (*CUDA_KERNEL_FLAGS, "head_kernel", "cuda_graphs"):
        if getattr(cfg, flag) and device.type != "cuda":
            raise ConfigError(f"{flag}=true needs a CUDA device (device={cfg.device} is {device.type})")
    texts = read_prompts(cfg)
    target = open_model(cfg.ckpt, "ckpt")
    if target.tokenizer.vocab_size > target.vocab_size:
        raise ConfigError(f"{target.setting}: its tokenizer has {target.tokenizer.vocab_size} tokens, more than the "
                          f"model's vocabulary of {target.vocab_size}")
    if (bad := sampler.bias_outside(target.tokenizer.vocab_size)) is not None:
        raise ConfigError(f"sampler.logit_bias holds token id {bad}, outside the tokenizer's vocabulary "
                          f"(0..{target.tokenizer.vocab_size - 1})")
    prompts = prepare_prompts([target.tokenizer.encode(t) for t in texts], cfg.max_new_tokens, target.max_seq_len,
                              cfg.truncate)
    draft = None if cfg.draft in (None, MTP_DRAFT) else open_model(cfg.draft, "draft")
    if draft is not None:
        check_draft(target, draft, target.tokenizer, draft.tokenizer)  # ModelSource has the vocab_size it reads
    calibration = calibration_source(cfg, target) if cfg.quant is not None else None

    model = target.load().to(device, dtype)
    if cfg.quant is not None:
        # the megakernel reads the layout of one kernel (on CUDA "auto" would pack int4 for tinygemm)
        quant = dataclasses.replace(QUANTS.resolve(cfg.quant)[1], kernel=QUANT_KERNEL) if cfg.megakernel else cfg.quant
        report = quantize(model, quant, calibration() if calibration else None, progress=True)
        print(f"lmlab generate: quantized {report['layers']} Linear layers ({report['quant']}, {report['method']}): "
              f"{report['bytes_before'] / 2**20:,.2f} -> {report['bytes_after'] / 2**20:,.2f} MiB", file=err)
    graphs = cfg.cuda_graphs is not False  # Engine replays graphs on CUDA only
    engine = Engine(model, compile=cfg.compile, cuda_graphs=graphs, megakernel=cfg.megakernel,
                    folded_norms=cfg.folded_norms, batch_invariant=cfg.batch_invariant, head_kernel=cfg.head_kernel)
    draft_engine = (Engine(draft.load().to(device, dtype), compile=cfg.compile, cuda_graphs=graphs,
                           megakernel=cfg.megakernel, head_kernel=cfg.head_kernel) if draft is not None else None)
    options = dict(max_new_tokens=cfg.max_new_tokens, stop_token_ids=target.stop_ids, stop_strings=cfg.stop,
                   tokenizer=target.tokenizer)

    def run(batch: list[list[int]], stream):
        if cfg.draft is None:
            return engine.generate(batch, sampler, stream=stream, **options)
        return speculative_generate(engine, draft_engine, batch[0], sampler, cfg.draft_k, stream=stream, **options)

    batch_size = cfg.batch_size if cfg.draft is None else 1  # speculative decoding runs one sequence
    for start in range(0, len(prompts), batch_size):
        printer = StreamPrinter(target.tokenizer, target.stop_ids, cfg.stop, out) if cfg.prompt is not None else None
        generation = run(prompts[start:start + batch_size], printer)
        if printer is not None:
            printer.show(generation.texts[0])
            out.write("\n")
        else:
            for prompt, text, reason in zip(texts[start:], generation.texts, generation.finish_reasons):
                out.write(json.dumps({"prompt": prompt, "completion": text, "finish_reason": reason},
                                     ensure_ascii=False) + "\n")
        out.flush()
        print(stats_line(generation), file=err)


def usage() -> str:
    keys = format_section(Section("keys", GenerateConfig, "", "KEY=VALUE"), {"sampler", "quant"}, set())
    return f"{__doc__}\n{keys}"


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    cfg = parse_config(argv)
    try:
        generate(cfg)
    except GenerationError as stopped:  # the model's fault, not the command line's
        print(f"lmlab generate: error: {stopped}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C ends a streamed completion: a new line, no traceback
        print(file=sys.stderr)
        return 130
    return 0
