//! A request's prompt as block hashes in its model's scope.

use crate::config::Config;
use crate::hash::{
    keyed_byte_chunk_hashes, keyed_token_block_hashes, root_hash, salt_digest, BlockHash, Domain,
};
use crate::request::{Prompt, PromptRequest};

/// A request's prompt as block hashes in its model's scope.
#[derive(Debug, Clone, PartialEq)]
pub struct HashedPrompt {
    /// The model pods must serve (the base model for a LoRA adapter).
    pub serving_model: String,
    pub domain: Domain,
    pub hashes: Vec<BlockHash>,
    /// The prompt's length in blocks: `hashes.len()`, or more when only a
    /// prefix's hashes are known (recalled from the token memo).
    pub blocks: usize,
}

/// Hashes a parsed request per the configuration (block size, chunk size,
/// cap, adapter scoping). A `cache_salt` enters block 0 as vLLM's extra key
/// (see `hash`), in both domains, so salts never share blocks.
pub fn hash_prompt(config: &Config, request: &PromptRequest) -> HashedPrompt {
    let serving_model = serving_model(config, &request.model);
    let lora = config
        .adapters
        .contains_key(&request.model)
        .then_some(request.model.as_str());
    let extra = [request.cache_salt.as_deref().and_then(salt_digest)];
    let (domain, hashes) = match &request.prompt {
        Prompt::Tokens(tokens) => {
            let root = root_hash(Domain::Tokens, &serving_model, lora);
            (
                Domain::Tokens,
                keyed_token_block_hashes(
                    root,
                    tokens,
                    config.block_size,
                    config.max_blocks,
                    &extra,
                ),
            )
        }
        Prompt::Text(text) => {
            let root = root_hash(Domain::Bytes, &serving_model, lora);
            (
                Domain::Bytes,
                keyed_byte_chunk_hashes(root, text, config.chunk_bytes, config.max_blocks, &extra),
            )
        }
    };
    HashedPrompt {
        serving_model,
        domain,
        blocks: hashes.len(),
        hashes,
    }
}

/// The model pods must serve for a request naming `model`: the base model
/// of a configured LoRA adapter, else the model itself.
pub fn serving_model(config: &Config, model: &str) -> String {
    config
        .adapters
        .get(model)
        .cloned()
        .unwrap_or_else(|| model.to_owned())
}
