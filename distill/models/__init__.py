"""The models: loading and checking Hugging Face causal LMs (`causal_lm`), LoRA students
(`lora`), the run's tokenizer (`tokenizers`), speed levers (`levers`) and FSDP for a
student and a teacher (`strategies`)."""
