"""torchtitan's trainer on the tdist backend, with torch.compile async TP through tdist's ops.

    torchrun --nproc-per-node 4 -m torch_tdist.titan [--backend tdist|nccl] <torchtitan flags>

Written for torchtitan 0.2.2 (the release for torch 2.11) on GPUs. Before the trainer starts it:

- makes ``--backend`` (default tdist) the process group's backend for CUDA tensors;
- serves async TP of llama3 models (``--parallelism.enable_async_tensor_parallel`` with ``--compile.enable``) on a
  tdist TP mesh with ``torch_tdist.async_tp.enable``; on an NCCL mesh it enables torch's symmetric
  memory for the group, which torchtitan 0.2.2 leaves out (so that torch 2.11's pass fuses nothing);
- adds the dataset ``synthetic`` (seeded random sentences, no download) and, unless
  ``--model.hf_assets_path`` is given, writes a small byte-level BPE tokenizer and uses it;
- adds llama3 flavors ``8B_<n>L`` and ``70B_<n>L``: LLaMA-3-8B's and LLaMA-3-70B's shapes (dim 4096
  and 8192, FFN 14336 and 28672, 32 and 64 heads, 8 KV heads, vocab 128256) with n layers, n = 1 to 8;
- stands in for ``datasets`` and ``torch.utils.tensorboard`` where they are not installed (only
  the Hugging Face loaders and the TensorBoard writer need them).

With ``--no-communication`` (``--backend tdist`` only, for measurements) every collective of the
job's tdist groups returns at once, moving nothing (the backend option ``communication``): the
step time with free communication, the bound overlap aims at; the losses are meaningless.
With ``--stats`` every rank prints, at the end, the fused regions tdist ran, the overlapped calls
of its TP group and the way tuning chose per shape class; ``--data-seed N`` seeds the sentences of
the ``synthetic`` dataset.
"""

from __future__ import annotations

import os
import sys

from . import launch  # noqa: F401  (importing it sets the NVLink-multicast safety variables)

BACKENDS = ("tdist", "nccl")
TOKENIZER_VOCAB = 2000
_WORDS = ("the of and to in is was for on that with as by at from his her it an are were be this which "
          "or have had not but one all also new first two after time year city world state river model "
          "train tensor parallel compile async gradient loss step layer attention token device memory "
          "kernel triton symmetric heap reduce scatter gather matmul shard replicate").split()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    backend = _pop_option(argv, "--backend", "tdist")
    stats = _pop_flag(argv, "--stats")  # print what tdist served, once training ends
    data_seed = int(_pop_option(argv, "--data-seed", "0"))  # of the synthetic dataset's sentences
    free = _pop_flag(argv, "--no-communication")
    if backend not in BACKENDS:
        raise SystemExit(f"torch_tdist.titan: --backend {backend}; expected one of {', '.join(BACKENDS)}")
    if free and backend != "tdist":
        raise SystemExit("torch_tdist.titan: --no-communication needs --backend tdist")
    if free:
        from .backend import set_default_options

        set_default_options({"communication": False})
    if not any(a.split("=")[0] == "--model.hf_assets_path" for a in argv):
        argv += ["--model.hf_assets_path", write_tokenizer(os.path.join(_cache_dir(), "tokenizer"))]
    sys.argv = [sys.argv[0], *argv]  # before torchtitan is imported: its parser reads them then
    _stand_in_for_missing_modules()
    import torch.distributed as dist  # (the package's import registered the backend "tdist")

    # torchtitan's init_distributed picks the backend of its device type from this map
    dist.Backend.default_device_backend_map["cuda"] = backend
    _add_synthetic_dataset(data_seed)
    _add_flavors()
    _serve_async_tp()

    from torchtitan.train import Trainer, main as train

    class _Trainer(Trainer):
        def close(self):
            if stats:
                _print_stats(self)
            super().close()

    train(_Trainer)


def _pop_flag(argv: list[str], name: str) -> bool:
    if name in argv:
        argv.remove(name)
        return True
    return False


def _pop_option(argv: list[str], name: str, default: str) -> str:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
        if arg.startswith(name + "="):
            del argv[i]
            return arg.split("=", 1)[1]
    return default


def _cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "torch_tdist", "titan")


def _sentences(seed: int):
    """Endless seeded sentences of a small vocabulary (words and random letter strings)."""
    import random

    rng = random.Random(seed)
    while True:
        words = [rng.choice(_WORDS) if rng.random() < 0.85 else
                 "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                 for _ in range(rng.randint(8, 60))]
        yield " ".join(words).capitalize() + "."


def write_tokenizer(directory: str, vocab: int = TOKENIZER_VOCAB) -> str:
    """A byte-level BPE tokenizer trained on ``_sentences`` (the same every time), saved as
    ``tokenizer.json`` and ``tokenizer_config.json`` in ``directory`` (what torchtitan's
    HuggingFaceTokenizer loads). Ranks may call it together: each file is replaced whole."""
    import itertools
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bos, eos, pad = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=1, special_tokens=[bos, eos, pad],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(itertools.islice(_sentences(1234), 4000), trainer=trainer)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    os.makedirs(directory, exist_ok=True)
    config = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "add_bos_token": False,
              "add_eos_token": False, "model_max_length": 1 << 20}
    for name, text in (("tokenizer.json", tokenizer.to_str()), ("tokenizer_config.json", json.dumps(config))):
        scratch = os.path.join(directory, f".{name}.{os.getpid()}")
        with open(scratch, "w") as f:
            f.write(text)
        os.replace(scratch, os.path.join(directory, name))
    return directory


def _add_synthetic_dataset(data_seed: int = 0):
    import datasets
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets

    def load(path):
        import itertools

        rows = [{"text": s} for s in itertools.islice(_sentences(data_seed), 20000)]
        return datasets.Dataset.from_list(rows) if hasattr(datasets.Dataset, "from_list") else datasets.Dataset(rows)

    text_datasets.DATASETS["synthetic"] = DatasetConfig(path="synthetic", loader=load,
                                                        sample_processor=lambda sample: sample["text"])


def _add_flavors():
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    for layers in range(1, 9):
        llama3.llama3_args.setdefault(f"8B_{layers}L", TransformerModelArgs(
            dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
            multiple_of=1024, rope_theta=500000))
        llama3.llama3_args.setdefault(f"70B_{layers}L", TransformerModelArgs(  # (FFN 28672, as 70B's)
            dim=8192, n_layers=layers, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
            multiple_of=4096, rope_theta=500000))


def _serve_async_tp():
    import torchtitan.distributed.tensor_parallel as tensor_parallel
    import torchtitan.models.llama3.infra.parallelize as llama3_parallelize

    from .async_tp import enable, enable_symm_mem
    from .backend import is_tdist_group

    titan_enable = tensor_parallel.maybe_enable_async_tp

    def maybe_enable_async_tp(job_config, tp_mesh):
        titan_enable(job_config, tp_mesh)  # checks compile is on, turns the pass on
        if not job_config.parallelism.enable_async_tensor_parallel:
            return
        if is_tdist_group(tp_mesh.get_group()):
            enable(tp_mesh)
        else:
            enable_symm_mem(tp_mesh.get_group().group_name)

    tensor_parallel.maybe_enable_async_tp = maybe_enable_async_tp
    llama3_parallelize.maybe_enable_async_tp = maybe_enable_async_tp  # (imported by name there)


def _print_stats(trainer):
    from . import async_tp
    from . import overlap
    from .backend import is_tdist_group

    tp_mesh = trainer.parallel_dims.get_optional_mesh("tp")
    overlapped, tuned = {}, {}
    if tp_mesh is not None and is_tdist_group(tp_mesh.get_group()):
        state = overlap.state(tp_mesh.get_group())
        overlapped, tuned = dict(state.fused_calls), state.tuning.tuned
    print(f"[torch_tdist.titan] rank {os.environ.get('RANK')}: fused regions tdist ran {dict(async_tp.served)}, "
          f"overlapped calls {overlapped}, tuned {tuned}", flush=True)


def _stand_in_for_missing_modules():
    """torchtitan imports ``datasets`` and ``torch.utils.tensorboard`` at start-up; where they are
    not installed, small stand-ins take their place (a list-backed Dataset; a SummaryWriter that
    refuses to start)."""
    import importlib
    import types

    def missing(name):
        try:
            importlib.import_module(name)
            return False
        except ImportError:
            return True

    if missing("torch.utils.tensorboard"):
        class SummaryWriter:
            def __init__(self, *args, **kwargs):
                raise RuntimeError("torch_tdist.titan: tensorboard is not installed; leave "
                                   "--metrics.enable_tensorboard off or install it")
        board = types.ModuleType("torch.utils.tensorboard")
        board.SummaryWriter = SummaryWriter
        sys.modules["torch.utils.tensorboard"] = board
    if missing("datasets"):
        class Dataset(list):
            def skip(self, n):
                return Dataset(self[n:])

        def load_dataset(*args, **kwargs):
            raise RuntimeError("torch_tdist.titan: Hugging Face datasets is not installed; use "
                               "--training.dataset synthetic or install it")

        def split_dataset_by_node(dataset, rank, world_size):
            return Dataset(dataset[rank::world_size]) if isinstance(dataset, Dataset) else dataset

        module = types.ModuleType("datasets")
        module.Dataset = module.IterableDataset = Dataset
        module.load_dataset = load_dataset
        distributed = types.ModuleType("datasets.distributed")
        distributed.split_dataset_by_node = split_dataset_by_node
        module.distributed = distributed
        sys.modules.update({"datasets": module, "datasets.distributed": distributed})


if __name__ == "__main__":
    main()
