"""Small packed-layout demo: ``python -m nemo_automodel_ext.demo``."""

from __future__ import annotations

import torch

from nemo_automodel_ext.models.deepseek_v41.packing import packed_layout


def main() -> None:
    seq_lens = torch.tensor([[3, 5, 0], [6, -1000, 2]])
    layout = packed_layout(seq_lens, None, (2, 9), 4)
    tokens = torch.arange(1, 19).view(2, 9)
    print("seq_lens          ", seq_lens.tolist())
    print("packed tokens     ", layout.pack(tokens, fill=0).tolist())
    print("sequence_ids      ", layout.sequence_ids.tolist())
    print("position_ids      ", layout.position_ids.tolist())
    print("restored tokens   ", layout.restore(layout.pack(tokens)).tolist())


if __name__ == "__main__":
    main()
