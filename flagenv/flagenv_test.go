package flagenv

import (
	"errors"
	"flag"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/buildinfo"
)

func TestEnvFillsUnsetFlagsOnly(t *testing.T) {
	t.Setenv("KVMESH_BLOCK_SIZE", "32")
	t.Setenv("KVMESH_MODEL", "from-env")
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	bs := fs.Int("block-size", 16, "block size")
	model := fs.String("model", "m", "model")
	if err := Parse(fs, []string{"--model", "from-flag"}); err != nil {
		t.Fatal(err)
	}
	if *bs != 32 || *model != "from-flag" {
		t.Fatalf("block-size=%d model=%q; want 32 from env and from-flag from args", *bs, *model)
	}
}

func TestBadEnvValueIsAnError(t *testing.T) {
	t.Setenv("KVMESH_BLOCK_SIZE", "many")
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	fs.Int("block-size", 16, "")
	if err := Parse(fs, nil); err == nil {
		t.Fatal("KVMESH_BLOCK_SIZE=many accepted")
	}
}

func TestVersionPrintsTheBuildAndEndsAsHelp(t *testing.T) {
	t.Setenv("KVMESH_VERSION", "true")
	fs := flag.NewFlagSet("router", flag.ContinueOnError)
	var out strings.Builder
	fs.SetOutput(&out)
	if err := Parse(fs, nil); err != nil {
		t.Fatalf("KVMESH_VERSION in the environment: %v, want it ignored", err)
	}
	if out.Len() != 0 {
		t.Fatalf("KVMESH_VERSION printed %q", out.String())
	}
	fs = flag.NewFlagSet("router", flag.ContinueOnError)
	fs.SetOutput(&out)
	if err := Parse(fs, []string{"--version"}); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--version: %v, want flag.ErrHelp", err)
	}
	if want := "router " + buildinfo.Version() + "\n"; out.String() != want {
		t.Fatalf("--version printed %q, want %q", out.String(), want)
	}
}
