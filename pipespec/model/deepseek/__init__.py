"""DeepSeek-V3 family targets: MLA over a paged latent cache, sigmoid-routed MoE (also GLM-4.5's)."""
