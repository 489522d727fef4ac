"""Dataset loaders: each reads the original files from a local folder or downloads them."""
