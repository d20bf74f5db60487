/* rope.c - the RoPE frequency table both backends use. See rope.h. */
#include "services/gpu-runner/rope.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>

/* inv_freq[i] for i in [0, head_dim/2), written as the float32 tensor operations of
 * transformers compute it (so the bits agree, not just the value):
 *   default: 1.0 / (theta ** (arange(0, hd, 2).float() / hd))  -- exponent rounded to float,
 *            powf, then reciprocal (Tensor.__rtruediv__ is reciprocal() * 1.0);
 *   linear:  inv_freq / factor;
 *   llama3:  wavelen = reciprocal(inv_freq) * float(2 pi); low-frequency components (wavelen >
 *            orig / low_freq_factor) are divided by factor, high-frequency ones (wavelen <
 *            orig / high_freq_factor) kept, the band between blended with
 *            smooth = (reciprocal(wavelen) * orig - low) / (high - low):
 *            (1 - smooth) * inv / factor + smooth * inv.
 * Returns 0, or -EINVAL with a message for parameters that give no finite frequencies. */
int rope_inv_freq(const struct model_config *cfg, float *inv, char *err, size_t errlen)
{
	uint32_t hd = cfg->head_dim;
	float theta = cfg->rope_theta;
	if (!(theta > 1.0f) || !isfinite(theta)) {
		snprintf(err, errlen, "rope_theta %g is not a finite number > 1", (double)theta);
		return -EINVAL;
	}
	for (uint32_t i = 0; i < hd / 2; i++) {
		float e = (float)(2 * i) / (float)hd;
		inv[i] = 1.0f / powf(theta, e);
	}
	if (cfg->rope_scaling == ROPE_SCALING_NONE)
		return 0;
	float factor = cfg->rope_factor;
	if (!(factor > 0.0f) || !isfinite(factor)) {
		snprintf(err, errlen, "rope_scaling factor %g is not a finite number > 0", (double)factor);
		return -EINVAL;
	}
	if (cfg->rope_scaling == ROPE_SCALING_LINEAR) {
		for (uint32_t i = 0; i < hd / 2; i++)
			inv[i] = inv[i] / factor;
		return 0;
	}
	if (cfg->rope_scaling != ROPE_SCALING_LLAMA3) {
		snprintf(err, errlen, "unknown rope_scaling type %u", cfg->rope_scaling);
		return -EINVAL;
	}
	float low = cfg->rope_low_freq_factor, high = cfg->rope_high_freq_factor;
	float orig = (float)cfg->rope_original_max_position;
	if (!(low > 0.0f) || !(high > low) || !isfinite(high) || cfg->rope_original_max_position == 0) {
		snprintf(err, errlen,
			 "llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor and "
			 "original_max_position_embeddings > 0 (got low %g, high %g, original %u)",
			 (double)low, (double)high, cfg->rope_original_max_position);
		return -EINVAL;
	}
	/* Python computes these two in double; torch compares them with float32 tensors, which
	 * rounds them to float32 first. */
	float low_wavelen = (float)((double)cfg->rope_original_max_position / (double)low);
	float high_wavelen = (float)((double)cfg->rope_original_max_position / (double)high);
	float band = (float)((double)high - (double)low);
	float two_pi = (float)(2.0 * M_PI);
	for (uint32_t i = 0; i < hd / 2; i++) {
		float f = inv[i];
		float wavelen = (1.0f / f) * two_pi;
		float scaled = wavelen > low_wavelen ? f / factor : f;
		if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
			float smooth = ((1.0f / wavelen) * orig - low) / band;
			scaled = (1.0f - smooth) * scaled / factor + smooth * scaled;
		}
		inv[i] = scaled;
	}
	return 0;
}
