"""Mixed precision: fp16 loss scaling, bf16 with fp32 master weights, autocast."""
