"""Serving a trained model: servable run dirs, continuous-batching generation, the OpenAI-style server."""
