"""Codecs: composable, self-describing stages that turn a tensor chunk into bytes and back.

Importing this package registers every codec, so ``codec_from_dict`` / ``Pipeline.from_list``
can rebuild any pipeline a manifest names. Stage: encode. The codecs hold no policy (which
tensors are lossy, with which parameters: ``saving.plan``) and import nothing from ``saving``.
"""
from .base import ArrayCodec, BytesCodec, EncodeStats, codec_from_dict, register
from .cast import CastCodec
from .int8_block import Int8BlockCodec
from .pipeline import Pipeline, index_pipeline, lossless_pipeline, lossy_pipeline
from .raw import RawCodec, dtype_itemsize
from .shuffle import ShuffleCodec
from .shuffle_zstd import ShuffleZstdCodec
from .uniform import UniformCodec
from .zstd import ZstdCodec

__all__ = [
    "ArrayCodec", "BytesCodec", "EncodeStats", "codec_from_dict", "register",
    "RawCodec", "CastCodec", "UniformCodec", "Int8BlockCodec", "ShuffleCodec", "ZstdCodec",
    "ShuffleZstdCodec",
    "Pipeline", "index_pipeline", "lossless_pipeline", "lossy_pipeline", "dtype_itemsize",
]
