"""The scripts' name for glm53_flash/device_weights.py (RankSource: one rank's random weights made on the device)."""
from glm53_flash.device_weights import EMBED, FP8_SCALE, RankSource, piece_bytes, piece_fp8  # noqa: F401
