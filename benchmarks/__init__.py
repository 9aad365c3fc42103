"""The benchmark harness: gdnkit backends beside FLA and FlashQLA (python -m gdnkit bench)."""
