//! The model family: architecture, tensor layout, quantization, weights and the forward pass.

pub mod architecture;
pub mod body;
pub mod config;
pub mod depth;
pub mod flops;
pub mod forward;
pub mod layout;
pub mod quant;
pub mod state_init;
pub mod synth;
pub mod weights;
