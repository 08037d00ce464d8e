from hybridrl.models.factory import (
    build_model,
    load_model_and_tokenizer,
    model_size_config,
    new_file_mode,
    save_model_dir,
)

__all__ = [
    "build_model",
    "load_model_and_tokenizer",
    "model_size_config",
    "new_file_mode",
    "save_model_dir",
]
