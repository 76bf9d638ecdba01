"""A trained student as a Hugging Face folder: saved at the end of a run (`callback`), with
its model card and the upload to the Hub (`card`). `distill-export` (distill.run.export)
does the same from any checkpoint."""
