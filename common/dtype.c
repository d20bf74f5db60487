#include "common/dtype.h"

#include "common/quant.h"

#include <errno.h>
#include <string.h>

static const char *const names[DT_COUNT] = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"};

const char *dtype_name(enum dtype t)
{
	return (unsigned)t < DT_COUNT ? names[t] : "?";
}

int dtype_parse(const char *text, enum dtype *out)
{
	for (int i = 0; i < DT_ELEMENT_COUNT; i++) {
		if (!strcmp(text, names[i])) {
			*out = (enum dtype)i;
			return 0;
		}
	}
	static const char *const known[] = {"F64", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2",
					    "U16", "U32", "U64", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"};
	for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++)
		if (!strcmp(text, known[i]))
			return -ENOTSUP;
	return -EINVAL;
}

float f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	uint32_t exp = (h >> 10) & 0x1fu;
	uint32_t mant = h & 0x3ffu;
	uint32_t u;
	if (exp == 0) {
		if (mant == 0) {
			u = sign;
		} else { /* subnormal: normalise */
			int e = -1;
			do {
				e++;
				mant <<= 1;
			} while (!(mant & 0x400u));
			u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
		}
	} else if (exp == 31) {
		u = sign | 0x7f800000u | (mant << 13);
	} else {
		u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
	}
	float f;
	memcpy(&f, &u, 4);
	return f;
}

uint16_t f32_to_f16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	uint32_t sign = (u >> 16) & 0x8000u;
	uint32_t abs = u & 0x7fffffffu;
	if (abs > 0x7f800000u)
		return (uint16_t)(sign | 0x7e00u);
	if (abs >= 0x477ff000u) /* rounds to >= 65520: infinity */
		return (uint16_t)(sign | 0x7c00u);
	if (abs < 0x38800000u) { /* below the smallest normal: subnormal or zero */
		if (abs < 0x33000000u)
			return (uint16_t)sign;
		uint32_t e = abs >> 23;
		uint32_t m = (abs & 0x7fffffu) | 0x800000u;
		/* value = m * 2^(e-150); in units of the f16 subnormal step 2^-24: m / 2^(126-e) */
		uint32_t s = 126 - e;
		uint32_t q = m >> s;
		uint32_t rem = m & ((1u << s) - 1u);
		uint32_t halfway = 1u << (s - 1);
		if (rem > halfway || (rem == halfway && (q & 1u)))
			q++;
		return (uint16_t)(sign | q);
	}
	uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);
	return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

void dtype_to_f32(enum dtype t, const void *src, float *dst, size_t n)
{
	if (t == DT_F32) {
		memcpy(dst, src, n * 4);
	} else if (t == DT_BF16) {
		const uint16_t *s = src;
		for (size_t i = 0; i < n; i++)
			dst[i] = bf16_to_f32(s[i]);
	} else if (t == DT_F16) {
		const uint16_t *s = src;
		for (size_t i = 0; i < n; i++)
			dst[i] = f16_to_f32(s[i]);
	} else {
		quant_dequantize(t, src, dst, n);
	}
}
