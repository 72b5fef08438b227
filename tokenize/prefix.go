package tokenize

// DefaultMaxPrefixTokens is how many leading tokens routing looks at unless
// configured otherwise (max_prefix_tokens).
const DefaultMaxPrefixTokens = 16384

// prefixEncoder is implemented by models that can stop tokenizing early.
type prefixEncoder interface {
	encodePrefix(text string, addSpecialTokens bool, maxTokens int) ([]uint32, error)
	encodeChatPrefix(chat Chat, maxTokens int) (string, []uint32, error)
}

// Prefix returns a Model that yields at most maxTokens leading ids of m's
// output (DefaultMaxPrefixTokens if maxTokens <= 0). The router matches
// cached prefixes only, so oversized prompts are truncated for matching;
// what is forwarded to the engine is untouched. For *HF the work stops as
// soon as the budget is spent: the rest of the prompt is not split,
// normalised or merged. Chat templates are still rendered in full.
func Prefix(m Model, maxTokens int) Model {
	if maxTokens <= 0 {
		maxTokens = DefaultMaxPrefixTokens
	}
	return prefixModel{m, maxTokens}
}

type prefixModel struct {
	m   Model
	max int
}

func (p prefixModel) Encode(text string, addSpecialTokens bool) ([]uint32, error) {
	if pe, ok := p.m.(prefixEncoder); ok {
		return pe.encodePrefix(text, addSpecialTokens, p.max)
	}
	ids, err := p.m.Encode(text, addSpecialTokens)
	return truncate(ids, p.max), err
}

func (p prefixModel) EncodeChat(chat Chat) (string, []uint32, error) {
	if pe, ok := p.m.(prefixEncoder); ok {
		return pe.encodeChatPrefix(chat, p.max)
	}
	prompt, ids, err := p.m.EncodeChat(chat)
	return prompt, truncate(ids, p.max), err
}

func truncate(ids []uint32, n int) []uint32 {
	if len(ids) > n {
		return ids[:n:n]
	}
	return ids
}

func (t *HF) encodePrefix(text string, addSpecialTokens bool, maxTokens int) ([]uint32, error) {
	return t.appendEncode(make([]uint32, 0, min(len(text)/3+4, maxTokens+8)), text, addSpecialTokens, maxTokens)
}

func (t *HF) encodeChatPrefix(chat Chat, maxTokens int) (string, []uint32, error) {
	return t.encodeChat(t.chat, chat, maxTokens)
}
