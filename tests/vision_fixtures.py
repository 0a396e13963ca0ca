"""Vision-language test models built in the test session: a tiny Qwen2-VL with a stand-in
for its processor (tests/test_vision.py, tests/test_vision_multiturn.py)."""

from __future__ import annotations

import torch


class _QwenProcessor:
    """Qwen2-VL's processing where transformers' own processor cannot be built (it needs
    torchvision for its video part): the PIL image processor, and each image token expanded
    into ``t * h * w / merge**2`` copies, as Qwen2VLProcessor does."""

    image_token = "<|image_pad|>"
    chat_template = None

    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor

    def __call__(self, text, images, add_special_tokens=False):
        grids = self.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
        merge = self.image_processor.merge_size**2
        pieces = text[0].split(self.image_token)
        out = pieces[0]
        for grid, piece in zip(grids, pieces[1:], strict=True):
            out += self.image_token * (int(grid.prod()) // merge) + piece
        return self.tokenizer([out], add_special_tokens=add_special_tokens)


def tiny_qwen2_vl():
    """A random tiny Qwen2-VL (eval mode) and its stand-in processor."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from dapo.models.tiny import build_tokenizer

    tok = build_tokenizer()
    special = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": special})
    images = Qwen2VLImageProcessorPil(
        min_pixels=16 * 16, max_pixels=64 * 64, patch_size=8, merge_size=2, temporal_patch_size=2
    )
    ids = dict(zip(special, tok.convert_tokens_to_ids(special), strict=True))
    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [2, 3, 3],
            },
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "patch_size": 8,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "mlp_ratio": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        video_token_id=ids["<|video_pad|>"],
        tie_word_embeddings=True,
    )
    return Qwen2VLForConditionalGeneration(config).eval(), _QwenProcessor(tok, images)
