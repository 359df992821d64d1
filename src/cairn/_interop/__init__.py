"""Other formats: readers of Orbax, PyTorch DCP, safetensors and torch.save files as load sources, conversion into cairn, export to safetensors and PyTorch files, numpy <-> torch."""
