"""Model definitions and loading: text encoders (transformers) and vision transformers (timm), each with a layer
view."""

from models.layers import ActivationState, Layer, run_layers
from models.text_encoder import TextEncoder, load_text_encoder
from models.vit import VisionClassifier, load_vit

__all__ = ["ActivationState", "Layer", "run_layers", "TextEncoder", "load_text_encoder", "VisionClassifier", "load_vit"]
