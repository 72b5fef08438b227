// Package k8s holds the example Kubernetes manifests (the YAML files beside
// this test) and checks them offline, without a cluster: each document is
// decoded strictly into its typed k8s.io/api object (an unknown or misspelt
// field is an error, as `kubectl apply` with server-side field validation
// would say), then cross-checked for the mistakes a schema cannot see: a
// volume mounted but not defined, a Secret or ConfigMap that no manifest
// creates, a Service or policy selecting no pod, a port name no container
// has, an env reference $(VAR) that is not set, an image on :latest, and
// arguments the kvmesh binaries do not accept (their flag sets, read from
// `-h` of binaries built for the test).
package k8s

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// TestManifests: the shipped manifests have no error.
func TestManifests(t *testing.T) {
	files, err := filepath.Glob("*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests: %v", err)
	}
	for _, e := range validate(t, files) {
		t.Error(e)
	}
}

// TestBrokenManifestsAreCaught: every mistake planted in testdata/broken is
// reported, each by what it is.
func TestBrokenManifestsAreCaught(t *testing.T) {
	files, err := filepath.Glob("testdata/broken/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no broken manifests: %v", err)
	}
	errs := validate(t, files)
	want := []string{
		`unknown field "volumeMount"`,
		`volume "cache" is mounted but not defined`,
		`ConfigMap "tokenizer" is used but no manifest creates it`,
		`Secret "kvmesh" has no key "admin-tokn"`,
		`selector matches no pod template`,
		`targetPort "metrics" is no container port`,
		`$(POD_IP) is not set`,
		`image "vllm/vllm-openai:latest" is not pinned`,
		`router does not accept --polcy`,
		`selector does not match its template's labels`,
		`PodDisruptionBudget routers: selector matches no pod template`,
		`NetworkPolicy router: port "kv-events" is no container port`,
		`volume "scratch" is defined but mounted nowhere`,
	}
	for _, w := range want {
		if !slices.ContainsFunc(errs, func(e string) bool { return strings.Contains(e, w) }) {
			t.Errorf("not caught: %s", w)
		}
	}
	if len(errs) != len(want) {
		t.Errorf("%d errors for %d planted mistakes:\n%s", len(errs), len(want), strings.Join(errs, "\n"))
	}
}

// manifests is what a set of files creates, by kind.
type manifests struct {
	deployments []*appsv1.Deployment
	services    []*corev1.Service
	// created holds the keys of each Secret and ConfigMap, as "Kind/name".
	created  map[string]map[string]bool
	pdbs     []*policyv1.PodDisruptionBudget
	policies []*networkingv1.NetworkPolicy
}

// validate decodes files and returns every error found, each naming its file
// and object.
func validate(t *testing.T, files []string) []string {
	m := manifests{created: map[string]map[string]bool{}}
	var errs []string
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range splitDocs(data) {
			if err := m.decode(doc); err != nil {
				errs = append(errs, fmt.Sprintf("%s, document %d: %v", f, i+1, err))
			}
		}
	}
	return append(errs, m.check(binaryFlags(t))...)
}

var docSep = regexp.MustCompile(`(?m)^---[ \t]*$`)

// splitDocs cuts a multi-document YAML stream, dropping documents that hold
// only comments.
func splitDocs(data []byte) [][]byte {
	var docs [][]byte
	for _, d := range docSep.Split(string(data), -1) {
		var v map[string]any
		if yaml.Unmarshal([]byte(d), &v) == nil && len(v) == 0 {
			continue
		}
		docs = append(docs, []byte(d))
	}
	return docs
}

// decode reads one document strictly into the type its apiVersion and kind
// name; a kind the examples do not use is an error too, so that a new one
// gets its checks here.
func (m *manifests) decode(doc []byte) error {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return err
	}
	var (
		obj any
		add func()
	)
	switch tm.APIVersion + " " + tm.Kind {
	case "apps/v1 Deployment":
		obj, add = collect(&m.deployments)
	case "v1 Service":
		obj, add = collect(&m.services)
	case "policy/v1 PodDisruptionBudget":
		obj, add = collect(&m.pdbs)
	case "networking.k8s.io/v1 NetworkPolicy":
		obj, add = collect(&m.policies)
	case "v1 Secret":
		s := new(corev1.Secret)
		obj, add = s, func() { m.created["Secret/"+s.Name] = keySet(s.Data, s.StringData) }
	case "v1 ConfigMap":
		c := new(corev1.ConfigMap)
		obj, add = c, func() { m.created["ConfigMap/"+c.Name] = keySet(c.Data, c.BinaryData) }
	default:
		return fmt.Errorf("kind %q of apiVersion %q: not one these checks know", tm.Kind, tm.APIVersion)
	}
	// An object that does not decode is left out of the cross-checks: what
	// was read of it before the error would only add noise.
	if err := yaml.UnmarshalStrict(doc, obj); err != nil {
		return fmt.Errorf("%s: %w", tm.Kind, err)
	}
	add()
	return nil
}

// check cross-checks the decoded objects.
func (m *manifests) check(flags map[string]map[string]bool) []string {
	var errs []string
	fail := func(obj, format string, a ...any) {
		errs = append(errs, obj+": "+fmt.Sprintf(format, a...))
	}
	for _, d := range m.deployments {
		obj := "Deployment " + d.Name
		sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
		if err != nil || sel.Empty() || !sel.Matches(labels.Set(d.Spec.Template.Labels)) {
			fail(obj, "selector does not match its template's labels")
		}
		m.checkPod(obj, &d.Spec.Template.Spec, flags, fail)
	}
	for _, s := range m.services {
		obj := "Service " + s.Name
		pods := m.podsMatching(labels.SelectorFromSet(s.Spec.Selector))
		if len(s.Spec.Selector) == 0 || len(pods) == 0 {
			fail(obj, "selector matches no pod template")
			continue
		}
		for _, p := range s.Spec.Ports {
			target := p.TargetPort
			if target.Type == intstr.Int && target.IntVal == 0 {
				target = intstr.FromInt32(p.Port)
			}
			if !slices.ContainsFunc(pods, func(ps *corev1.PodSpec) bool { return hasPort(ps, target, p.Protocol) }) {
				fail(obj, "targetPort %q is no container port of the pods it selects", target.String())
			}
		}
	}
	for _, p := range m.pdbs {
		if !m.selects(p.Spec.Selector) {
			fail("PodDisruptionBudget "+p.Name, "selector matches no pod template")
		}
	}
	for _, p := range m.policies {
		obj := "NetworkPolicy " + p.Name
		if !m.selects(&p.Spec.PodSelector) {
			fail(obj, "selector matches no pod template")
			continue
		}
		sel, _ := metav1.LabelSelectorAsSelector(&p.Spec.PodSelector)
		pods := m.podsMatching(sel)
		for _, rule := range p.Spec.Ingress {
			for _, port := range rule.Ports {
				proto := corev1.ProtocolTCP
				if port.Protocol != nil {
					proto = *port.Protocol
				}
				if port.Port != nil && !slices.ContainsFunc(pods, func(ps *corev1.PodSpec) bool { return hasPort(ps, *port.Port, proto) }) {
					fail(obj, "port %q is no container port of the pods it selects", port.Port.String())
				}
			}
		}
	}
	return errs
}

// checkPod checks one pod template: volumes, references, env, images, flags.
func (m *manifests) checkPod(obj string, ps *corev1.PodSpec, flags map[string]map[string]bool, fail func(string, string, ...any)) {
	volumes := map[string]bool{}
	for _, v := range ps.Volumes {
		volumes[v.Name] = false
		if v.ConfigMap != nil {
			m.need(obj, "ConfigMap", v.ConfigMap.Name, "", v.ConfigMap.Optional, fail)
		}
		if v.Secret != nil {
			m.need(obj, "Secret", v.Secret.SecretName, "", v.Secret.Optional, fail)
		}
	}
	for _, c := range slices.Concat(ps.InitContainers, ps.Containers) {
		cobj := obj + ", container " + c.Name
		for _, vm := range c.VolumeMounts {
			if _, ok := volumes[vm.Name]; !ok {
				fail(cobj, "volume %q is mounted but not defined", vm.Name)
			}
			volumes[vm.Name] = true
		}
		env := map[string]bool{}
		for _, e := range c.Env {
			env[e.Name] = true
			if r := e.ValueFrom; r != nil && r.SecretKeyRef != nil {
				m.need(cobj, "Secret", r.SecretKeyRef.Name, r.SecretKeyRef.Key, r.SecretKeyRef.Optional, fail)
			}
			if r := e.ValueFrom; r != nil && r.ConfigMapKeyRef != nil {
				m.need(cobj, "ConfigMap", r.ConfigMapKeyRef.Name, r.ConfigMapKeyRef.Key, r.ConfigMapKeyRef.Optional, fail)
			}
		}
		for _, e := range c.EnvFrom {
			if e.SecretRef != nil {
				m.need(cobj, "Secret", e.SecretRef.Name, "", e.SecretRef.Optional, fail)
			}
			if e.ConfigMapRef != nil {
				m.need(cobj, "ConfigMap", e.ConfigMapRef.Name, "", e.ConfigMapRef.Optional, fail)
			}
		}
		// Kubernetes leaves an unset $(VAR) in place: the program would get
		// the literal text.
		for _, a := range slices.Concat(c.Command, c.Args) {
			for _, ref := range envRef.FindAllStringSubmatch(a, -1) {
				if !env[ref[1]] {
					fail(cobj, "$(%s) is not set in the container's env", ref[1])
				}
			}
		}
		if !pinned(c.Image) {
			fail(cobj, "image %q is not pinned to a version", c.Image)
		}
		if len(c.Command) > 0 {
			if bin := filepath.Base(c.Command[0]); flags[bin] != nil {
				checkArgs(cobj, bin, c.Args, flags[bin], fail)
			}
		}
		for _, probe := range []*corev1.Probe{c.ReadinessProbe, c.LivenessProbe, c.StartupProbe} {
			if probe != nil && probe.HTTPGet != nil && !hasPort(&corev1.PodSpec{Containers: []corev1.Container{c}}, probe.HTTPGet.Port, corev1.ProtocolTCP) {
				fail(cobj, "probe port %q is no port of the container", probe.HTTPGet.Port.String())
			}
		}
	}
	for name, used := range volumes {
		if !used {
			fail(obj, "volume %q is defined but mounted nowhere", name)
		}
	}
}

// collect: a new object to decode into, and how to add it to list.
func collect[T any](list *[]*T) (any, func()) {
	v := new(T)
	return v, func() { *list = append(*list, v) }
}

// keySet: the keys of a Secret's or ConfigMap's two data maps.
func keySet[A, B any](a map[string]A, b map[string]B) map[string]bool {
	keys := map[string]bool{}
	for k := range a {
		keys[k] = true
	}
	for k := range b {
		keys[k] = true
	}
	return keys
}

var envRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// pinned: an explicit tag other than latest, or a digest. kvmesh:dev is the
// local build the README says to retag for the cluster.
func pinned(image string) bool {
	if strings.Contains(image, "@sha256:") {
		return true
	}
	i := strings.LastIndex(image, ":")
	return i > strings.LastIndex(image, "/") && image[i+1:] != "latest"
}

// checkArgs: every argument is --flag or --flag=value and the binary has the
// flag (the manifests use the = form only, so a value is never mistaken for
// a flag).
func checkArgs(obj, bin string, args []string, known map[string]bool, fail func(string, string, ...any)) {
	for _, a := range args {
		name, ok := strings.CutPrefix(a, "--")
		if !ok {
			fail(obj, "argument %q of %s is not --flag=value", a, bin)
			continue
		}
		name, _, _ = strings.Cut(name, "=")
		if !known[name] {
			fail(obj, "%s does not accept --%s", bin, name)
		}
	}
}

// need: a reference that is not optional names a Secret or ConfigMap that
// a manifest creates, holding key when one is named.
func (m *manifests) need(obj, kind, name, key string, optional *bool, fail func(string, string, ...any)) {
	if optional != nil && *optional {
		return
	}
	keys, ok := m.created[kind+"/"+name]
	if !ok {
		fail(obj, "%s %q is used but no manifest creates it", kind, name)
		return
	}
	if key != "" && !keys[key] {
		fail(obj, "%s %q has no key %q", kind, name, key)
	}
}

func (m *manifests) selects(ls *metav1.LabelSelector) bool {
	sel, err := metav1.LabelSelectorAsSelector(ls)
	return err == nil && !sel.Empty() && len(m.podsMatching(sel)) > 0
}

func (m *manifests) podsMatching(sel labels.Selector) []*corev1.PodSpec {
	var pods []*corev1.PodSpec
	for _, d := range m.deployments {
		if sel.Matches(labels.Set(d.Spec.Template.Labels)) {
			pods = append(pods, &d.Spec.Template.Spec)
		}
	}
	return pods
}

// hasPort: a container of the pod declares port (by number or name) with
// protocol (TCP when unset, as Kubernetes defaults it).
func hasPort(ps *corev1.PodSpec, port intstr.IntOrString, proto corev1.Protocol) bool {
	if proto == "" {
		proto = corev1.ProtocolTCP
	}
	for _, c := range ps.Containers {
		for _, p := range c.Ports {
			pp := p.Protocol
			if pp == "" {
				pp = corev1.ProtocolTCP
			}
			if pp != proto {
				continue
			}
			if port.Type == intstr.String && p.Name == port.StrVal || port.Type == intstr.Int && p.ContainerPort == port.IntVal {
				return true
			}
		}
	}
	return false
}

var (
	flagsOnce sync.Once
	flagSets  map[string]map[string]bool
	flagsErr  error
)

// binaryFlags builds the router and sidecar (static, like `make build`, so
// the build cache is shared) and reads their flag names from -h.
func binaryFlags(t *testing.T) map[string]map[string]bool {
	t.Helper()
	flagsOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kvmesh-k8s-flags")
		if err != nil {
			flagsErr = err
			return
		}
		defer os.RemoveAll(dir)
		bins := []string{"router", "sidecar"}
		args := []string{"build", "-trimpath", "-o", dir + string(filepath.Separator)}
		for _, b := range bins {
			args = append(args, "../../cmd/"+b)
		}
		build := exec.Command("go", args...)
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			flagsErr = fmt.Errorf("go build: %v\n%s", err, out)
			return
		}
		flagSets = map[string]map[string]bool{}
		for _, b := range bins {
			// -h exits 0 or 2 depending on the flag package's mode; the
			// listing is what matters.
			out, _ := exec.Command(filepath.Join(dir, b), "-h").CombinedOutput()
			names := map[string]bool{}
			for _, m := range flagLine.FindAllSubmatch(out, -1) {
				names[string(m[1])] = true
			}
			if len(names) < 5 || !bytes.Contains(out, []byte("-log-level")) {
				flagsErr = fmt.Errorf("%s -h lists %d flags:\n%s", b, len(names), out)
				return
			}
			flagSets[b] = names
		}
	})
	if flagsErr != nil {
		t.Fatal(flagsErr)
	}
	return flagSets
}

// flagLine is a flag's line in Go's flag.PrintDefaults: two spaces, a dash,
// the name, then a type word or the end of the line.
var flagLine = regexp.MustCompile(`(?m)^  -([a-zA-Z0-9][a-zA-Z0-9-]*)(?: |$)`)
