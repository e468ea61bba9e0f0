"""File formats and file writing: the safetensors format (:mod:`.safetensors_format`), atomic
output files (:mod:`.atomic`) and the one-writer lock of an output directory (:mod:`.dirlock`)."""
