"""File formats and file writing: the safetensors format (:mod:`.safetensors_format`) and atomic
output files (:mod:`.atomic`)."""
