"""Multimodal parts: synthetic captioned images, image-text data, vision encoders, contrastive losses,
projectors into the LM (VLM) and VQ image tokenizers (early fusion).

Images are float tensors (B, 3, H, W) in [0, 1]; encoders normalise internally.
"""
