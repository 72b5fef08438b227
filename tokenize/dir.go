package tokenize

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
)

// LoadDir loads a model directory as HuggingFace lays it out:
// tokenizer.json, plus tokenizer_config.json (bos_token and eos_token as
// strings or AddedToken dicts, added_tokens_decoder, add_bos_token and
// add_eos_token when set, chat_template as a string or a list of {name,
// template} of which "default" is used) and chat_template.jinja, which wins
// over the config's template, when present.
func LoadDir(dir string, opts ...Option) (*HF, error) {
	tj, err := os.ReadFile(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return nil, fmt.Errorf("tokenize: %w", err)
	}
	cfg, err := readTokenizerConfig(dir)
	if err != nil {
		return nil, err
	}
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	opts = append(opts, func(o *options) { o.extraAdded = cfg.added })
	t, err := Load(tj, opts...)
	if err != nil {
		return nil, err
	}
	t.bosToken, t.eosToken = cfg.bos, cfg.eos
	if err := t.applySpecialFlags(cfg); err != nil {
		return nil, err
	}
	// GPT2TokenizerFast and kin push add_prefix_space into a ByteLevel
	// pre-tokenizer (not into a Sequence).
	if bl, ok := t.soleByteLevel(); ok && cfg.addPrefixSpace != nil {
		bl.addPrefixSpace = *cfg.addPrefixSpace
	}
	if o.chatTemplate != nil { // WithChatTemplate wins over the directory
		return t, nil
	}
	t.chat, t.chatErr = nil, errNoChatTemplate
	if cfg.template == "" {
		t.chatErr = fmt.Errorf("tokenize: %s has no chat template", dir)
		if cfg.templateErr != nil {
			t.chatErr = cfg.templateErr
		}
		return t, nil
	}
	t.chat, t.chatErr = compileChatTemplate(cfg.template)
	return t, nil
}

type tokenizerConfig struct {
	bos, eos string
	// addBOS/addEOS are add_bos_token/add_eos_token when the file sets them.
	addBOS, addEOS *bool
	// addPrefixSpace is add_prefix_space when the file sets it.
	addPrefixSpace *bool
	added          []addedToken
	template       string
	templateErr    error
}

func readTokenizerConfig(dir string) (tokenizerConfig, error) {
	var cfg tokenizerConfig
	data, err := os.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return cfg, fmt.Errorf("tokenize: %w", err)
	default:
		if err := cfg.parse(data); err != nil {
			return cfg, err
		}
	}
	// A chat_template.jinja file wins over the config's template, as in
	// transformers.
	if src, err := os.ReadFile(filepath.Join(dir, "chat_template.jinja")); err == nil {
		cfg.template, cfg.templateErr = string(src), nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return cfg, fmt.Errorf("tokenize: %w", err)
	}
	return cfg, nil
}

func (cfg *tokenizerConfig) parse(data []byte) error {
	var j struct {
		BOS                json.RawMessage       `json:"bos_token"`
		EOS                json.RawMessage       `json:"eos_token"`
		AddedTokensDecoder map[string]addedToken `json:"added_tokens_decoder"`
		ChatTemplate       json.RawMessage       `json:"chat_template"`
		AddBOSToken        *bool                 `json:"add_bos_token"`
		AddEOSToken        *bool                 `json:"add_eos_token"`
		AddPrefixSpace     *bool                 `json:"add_prefix_space"`
	}
	if err := json.Unmarshal(data, &j); err != nil {
		return fmt.Errorf("tokenize: tokenizer_config.json: %w", err)
	}
	cfg.addBOS, cfg.addEOS, cfg.addPrefixSpace = j.AddBOSToken, j.AddEOSToken, j.AddPrefixSpace
	var err error
	if cfg.bos, err = tokenContent(j.BOS); err != nil {
		return fmt.Errorf("tokenize: tokenizer_config.json bos_token: %w", err)
	}
	if cfg.eos, err = tokenContent(j.EOS); err != nil {
		return fmt.Errorf("tokenize: tokenizer_config.json eos_token: %w", err)
	}
	for key, a := range j.AddedTokensDecoder {
		id, err := strconv.ParseUint(key, 10, 32)
		if err != nil {
			return fmt.Errorf("tokenize: tokenizer_config.json added_tokens_decoder: bad id %q", key)
		}
		a.ID = uint32(id)
		cfg.added = append(cfg.added, a)
	}
	if isNull(j.ChatTemplate) {
		return nil
	}
	if err := json.Unmarshal(j.ChatTemplate, &cfg.template); err == nil {
		return nil
	}
	var named []struct {
		Name     string `json:"name"`
		Template string `json:"template"`
	}
	if err := json.Unmarshal(j.ChatTemplate, &named); err != nil {
		return fmt.Errorf("tokenize: tokenizer_config.json chat_template must be a string or a list of {name, template}: %w", err)
	}
	for _, n := range named {
		if n.Name == "default" {
			cfg.template = n.Template
			return nil
		}
	}
	cfg.templateErr = errors.New("tokenize: tokenizer_config.json chat_template has no template named \"default\"")
	return nil
}

// tokenContent reads a special token given as a string, an AddedToken dict
// or null.
func tokenContent(raw json.RawMessage) (string, error) {
	if isNull(raw) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var d struct {
		Content string `json:"content"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		return "", err
	}
	return d.Content, nil
}

// applySpecialFlags honours add_bos_token/add_eos_token when the config sets
// them: transformers then rebuilds the post-processor as
// "[bos] $A [eos]" from those flags (LlamaTokenizerFast and kin), so the
// side a flag names follows it instead of tokenizer.json's template.
func (t *HF) applySpecialFlags(cfg tokenizerConfig) error {
	side := func(flag *bool, token, name string, ids *[]uint32) error {
		if flag == nil {
			return nil
		}
		if !*flag {
			*ids = nil
			return nil
		}
		id, ok := t.tokenID(token)
		if !ok {
			return fmt.Errorf("tokenize: tokenizer_config.json sets %s but its token %q is not in the vocabulary", name, token)
		}
		*ids = []uint32{id}
		return nil
	}
	if err := side(cfg.addBOS, cfg.bos, "add_bos_token", &t.postBefore); err != nil {
		return err
	}
	return side(cfg.addEOS, cfg.eos, "add_eos_token", &t.postAfter)
}

func (t *HF) soleByteLevel() (*byteLevelPre, bool) {
	if len(t.pre) != 1 {
		return nil, false
	}
	bl, ok := t.pre[0].(*byteLevelPre)
	return bl, ok
}
