"""`lmlab serve ckpt=PATH [KEY=VALUE ...]`: an OpenAI-compatible HTTP server over a checkpoint.

    lmlab serve ckpt=outputs/runs/<date>/<time>/checkpoints/last.ckpt port=8000
    lmlab serve ckpt=hf/my-model chat_template=chatml scheduler.max_num_seqs=64 block_size=16
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "<time>", "prompt": "def f(x):", "max_tokens": 32}'

Requests are batched continuously over a paged KV cache (`scheduler=static` for the baseline), with
prompt prefixes shared between requests. The model is named by its checkpoint's run folder, <time> above
(or model_name=); the server prints the name as it starts. Overrides are checked as in lmlab-train. Needs
the `serve` extra (FastAPI, uvicorn).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from lmlab.alignment.chat import CHAT_TEMPLATES, check_template_tokens
from lmlab.cli.compose import compose_config
from lmlab.cli.generate import device_and_dtype, open_model
from lmlab.cli.listing import Section, format_section
from lmlab.errors import ConfigError
from lmlab.serving.engine import ServingConfig, ServingEngine

@dataclass
class ServeConfig:
    ckpt: str | None = None  # an lmlab-train checkpoint, or a Hugging Face Llama folder
    model_name: str | None = None  # the `model` clients ask for (default: the checkpoint's run folder name)
    host: str = "127.0.0.1"
    port: int = 8000
    scheduler: Any = MISSING  # continuous | static (lmlab list scheduler), with max_num_seqs, max_num_batched_tokens
    chat_template: Any = MISSING  # how /v1/chat/completions renders messages (lmlab list chat_template)
    max_waiting: int = 1024  # requests waiting for admission before new ones get HTTP 429
    num_blocks: int | None = None  # KV blocks, 1 for padding included; None: kv_memory_fraction of free GPU memory
    block_size: int = 16  # token slots per KV block
    kv_memory_fraction: float = 0.8
    prefix_caching: bool = True  # requests with equal prompt prefixes share their KV blocks
    device: str = "auto"  # auto (cuda when there is one) | cpu | cuda
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16
    attention_kernel: bool | None = None  # Triton paged decode attention; None: on CUDA
    cuda_graphs: bool | None = None  # decode steps replayed from CUDA graphs; None: on CUDA
    plugins: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        if self.max_waiting < 1:
            raise ConfigError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ConfigError(f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2 (one is kept for padding), got {self.num_blocks}; or leave "
                              "it unset to size the pool from kv_memory_fraction")


ConfigStore.instance().store(name="serve_schema", node=ServeConfig)


def parse_config(argv: list[str]) -> ServeConfig:
    if stray := [a for a in argv if "=" not in a]:
        raise ConfigError(f"unexpected argument '{stray[0]}': arguments are KEY=VALUE (lmlab serve --help)")
    cfg: ServeConfig = OmegaConf.to_object(compose_config(argv, config_name="serve"))
    if cfg.ckpt is None:
        raise ConfigError("no model: pass ckpt=PATH (a checkpoint lmlab-train wrote, or a Hugging Face Llama folder)")
    return cfg


def default_model_name(ckpt: str) -> str:
    """The run folder of outputs/runs/<date>/<time>/checkpoints/last.ckpt, or the checkpoint's own name."""
    path = Path(ckpt)
    if path.is_file() and path.parent.name == "checkpoints":
        return path.parent.parent.name
    return path.stem if path.is_file() else path.name


def build_server(cfg: ServeConfig):
    """The model loaded, the engine started and the FastAPI app: everything but listening."""
    from lmlab.serving.async_engine import AsyncEngine  # the serve extra: imported once a server is asked for
    from lmlab.serving.server import build_app

    device, dtype = device_and_dtype(cfg)
    if cfg.cuda_graphs and device.type != "cuda":
        raise ConfigError(f"cuda_graphs=true needs a CUDA device (device={cfg.device} is {device.type})")
    template = CHAT_TEMPLATES.build(cfg.chat_template)
    source = open_model(cfg.ckpt, "ckpt")
    check_template_tokens(source.tokenizer, template)  # before the weights load
    model = source.load().to(device, dtype)
    serving = ServingConfig(num_blocks=cfg.num_blocks, block_size=cfg.block_size,
                            kv_memory_fraction=cfg.kv_memory_fraction, scheduler=cfg.scheduler,
                            prefix_caching=cfg.prefix_caching, attention_kernel=cfg.attention_kernel,
                            cuda_graphs=cfg.cuda_graphs)
    engine = AsyncEngine(ServingEngine(model, source.tokenizer, serving, stop_ids=source.stop_ids),
                         max_waiting=cfg.max_waiting).start()
    name = cfg.model_name or default_model_name(cfg.ckpt)
    app = build_app(engine, name, source.tokenizer, template, source.max_seq_len)
    blocks = engine.engine.blocks
    summary = (f"model `{name}` ({device}, {str(dtype).removeprefix('torch.')}), {blocks.usable:,} KV blocks of "
               f"{blocks.block_size} tokens ({blocks.num_blocks * engine.engine.runner.kv_bytes_per_block() / 2**30:.2f} GiB)")
    return app, name, summary


def usage() -> str:
    keys = format_section(Section("keys", ServeConfig, "", "KEY=VALUE"), {"scheduler", "chat_template"}, set())
    return f"{__doc__}\n{keys}"


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    cfg = parse_config(argv)
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("lmlab serve needs FastAPI and uvicorn: pip install 'lmlab[serve]'") from None
    app, _, summary = build_server(cfg)
    print(f"lmlab serve: {summary}, on http://{cfg.host}:{cfg.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="info")
    return 0
