#!/usr/bin/env python3
"""Differential-test oracle for image preprocessing: NeMo AutoModel 0.7.0's DeepSeek-V4.1 image sizing and pixels.

Run ONLY with the isolated oracle interpreter (see setup_oracle_venv.sh):

    .venv-oracle/bin/python tests/oracle/nemo_preprocess.py --vision-config VISION.json --out OUT.npz IMAGE...

``VISION.json`` is a ``vision_config`` object; each ``IMAGE`` an image file. ``OUT.npz`` receives, per image i,
``patches{i}`` (float32 of NeMo's patches [patch_rows * patch_cols, 3, p, p]) and ``grid{i}`` (int64: resized
height, width, patch rows, patch columns, LM rows, LM columns), from NeMo's processing module. Nothing from NeMo is
imported by the deepinfer package.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vision-config", required=True, help="JSON file holding a vision_config object")
    parser.add_argument("--out", required=True, help="output .npz")
    parser.add_argument("images", nargs="+", help="image files")
    args = parser.parse_args(argv)

    import numpy as np

    from nemo_automodel.components.models.deepseek_v41 import processing
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41VisionConfig

    with open(args.vision_config) as f:
        config = DeepseekV41VisionConfig(**json.load(f))
    out = {}
    for i, path in enumerate(args.images):
        patches, grid = processing._preprocess_image(path, config)
        out[f"patches{i}"] = patches.float().numpy()
        out[f"grid{i}"] = np.array([grid.height, grid.width, grid.vit_height, grid.vit_width, grid.llm_height,
                                    grid.llm_width], dtype=np.int64)
    np.savez(args.out, **out)
    print(f"[nemo_preprocess] {len(args.images)} images -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
