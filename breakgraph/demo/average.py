"""Average demo checkpoints of one shape into a new checkpoint (a uniform weight average).

Two training stages that start from the same weights learn different things in their few
minutes; the mean of their weights can keep what each learnt. The checkpoints must share their
``config.json`` and ``tokenizer.json`` and hold the same tensors (names, shapes, dtypes): each
floating-point tensor of the result is the fp32 mean, rounded to its dtype; any other tensor
must be equal in every checkpoint and is copied. The first checkpoint's other files (config,
tokenizer, generation config) are copied beside the weights; ``training.json`` is not (no one
run trained the result).

Run::

    python -m breakgraph.demo.average --models STAGE_A STAGE_B --output FOLDER
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"
SAME_IN_EVERY = ("config.json", "tokenizer.json")  # files whose bytes every checkpoint must share
NOT_COPIED = (WEIGHTS, "training.json")


def average_state(states: list[dict[str, torch.Tensor]], names: list[str]) -> dict[str, torch.Tensor]:
    """The uniform mean of ``states`` (one ``name → tensor`` dict per checkpoint; ``names`` label
    them in errors): floating tensors averaged in fp32 and rounded to their dtype, others copied
    once checked equal. Raises ``ValueError`` naming the first tensor that differs in presence,
    shape or dtype (or, not floating, in value), or that is an 8-bit float (FP8 codes)."""
    if len(states) < 2:
        raise ValueError(f"averaging needs at least two checkpoints, got {len(states)}")
    first, out = states[0], {}
    for state, name in zip(states[1:], names[1:]):
        if state.keys() != first.keys():
            diff = sorted(state.keys() ^ first.keys())
            raise ValueError(f"{name} and {names[0]} hold different tensors (first: {diff[0]!r})")
    for key, ref in first.items():
        if ref.dtype.itemsize == 1 and ref.is_floating_point():
            raise ValueError(f"tensor {key!r} is {ref.dtype} (codes scaled by other tensors): averaging codes is not averaging weights")
        for state, name in zip(states[1:], names[1:]):
            t = state[key]
            if t.shape != ref.shape or t.dtype != ref.dtype:
                raise ValueError(
                    f"tensor {key!r}: {name} has {tuple(t.shape)} {t.dtype}, {names[0]} {tuple(ref.shape)} {ref.dtype}"
                )
            if not ref.is_floating_point() and not torch.equal(t, ref):
                raise ValueError(f"tensor {key!r} ({ref.dtype}) differs between {name} and {names[0]}: it cannot be averaged")
        if ref.is_floating_point():
            total = torch.zeros(ref.shape, dtype=torch.float32)
            for state in states:
                total += state[key].float()
            out[key] = (total / len(states)).to(ref.dtype)
        else:
            out[key] = ref.clone()
    return out


def average_checkpoints(folders: list[Path], output: Path) -> Path:
    """Write the average of the checkpoint ``folders`` (each with ``model.safetensors``,
    ``config.json`` and ``tokenizer.json``) to ``output`` (created; may be one of ``folders``:
    every input is read before anything is written). Returns ``output``."""
    folders = [Path(f) for f in folders]
    for folder in folders:
        missing = [f for f in (WEIGHTS, *SAME_IN_EVERY) if not (folder / f).is_file()]
        if missing:
            raise ValueError(f"{folder} is not a demo checkpoint: no {', '.join(missing)}")
    for file in SAME_IN_EVERY:
        ref = (folders[0] / file).read_bytes()
        for folder in folders[1:]:
            if (folder / file).read_bytes() != ref:
                raise ValueError(f"{folder / file} differs from {folders[0] / file}: only checkpoints of one model average")
    states = [load_file(folder / WEIGHTS) for folder in folders]
    averaged = average_state(states, [str(f) for f in folders])
    extras = {p.name: p.read_bytes() for p in folders[0].iterdir() if p.is_file() and p.name not in NOT_COPIED}
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    for name, data in extras.items():
        (output / name).write_bytes(data)
    (output / "training.json").unlink(missing_ok=True)  # a record of one run, which no longer describes these weights
    tmp = output / (WEIGHTS + ".tmp")
    save_file(averaged, tmp, metadata={"format": "pt"})
    shutil.move(tmp, output / WEIGHTS)
    return output


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(
        prog="python -m breakgraph.demo.average",
        description="Average the weights of demo checkpoints of one shape (same config and tokenizer) into a new checkpoint.",
    )
    p.add_argument("--models", nargs="+", required=True, metavar="FOLDER",
                   help="checkpoint folders (model.safetensors, config.json, tokenizer.json), at least two")  # fmt: skip
    p.add_argument("--output", required=True, metavar="FOLDER",
                   help="folder to write the averaged checkpoint to (may be one of --models)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        out = average_checkpoints([Path(m) for m in args.models], Path(args.output))
    except ValueError as e:
        p.error(str(e))
    print(f"averaged {len(args.models)} checkpoints into {out}")
    return out


if __name__ == "__main__":
    main()
