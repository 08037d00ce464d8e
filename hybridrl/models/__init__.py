from hybridrl.models.factory import build_model, load_model_and_tokenizer, model_size_config

__all__ = ["build_model", "load_model_and_tokenizer", "model_size_config"]
