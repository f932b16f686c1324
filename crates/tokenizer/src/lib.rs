//! DeepSeek V4 tokenizer, chat encoding and DSML.
