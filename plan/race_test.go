//go:build race

package plan

// raceEnabled: the race detector makes loading real tokenizers take
// seconds.
const raceEnabled = true
