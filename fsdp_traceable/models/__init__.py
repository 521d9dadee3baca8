from .transformer import Transformer, TransformerConfig

__all__ = ["Transformer", "TransformerConfig"]
