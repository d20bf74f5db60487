#include "common/model.h"

static const char *const role_names[ROLE_COUNT] = {
	"embed", "attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down", "final_norm", "lm_head",
};

const char *tensor_role_name(enum tensor_role r)
{
	return (unsigned)r < ROLE_COUNT ? role_names[r] : "?";
}

const char *group_kind_name(enum group_kind k)
{
	switch (k) {
	case GROUP_EMBED:
		return "embed";
	case GROUP_ATTN:
		return "attn";
	case GROUP_FFN:
		return "ffn";
	case GROUP_HEAD:
		return "head";
	}
	return "?";
}
