package workload

import (
	"encoding/json"
	"fmt"
	"time"
)

// AgentParams shape the agent scenario: tool-using conversations (a coding
// assistant's loop). Each starts from one of a few agents' instructions and
// a user's task; every later turn brings the output of the tool the
// previous answer called, so histories grow by a function call and its
// output per turn.
type AgentParams struct {
	ConversationRate float64 // new conversations per simulated second
	MinTurns         int
	MaxTurns         int
	// Agents distinct instructions of InstructionTokens are shared by the
	// conversations (an agent's system prompt and tool manual).
	Agents, InstructionTokens int
	TaskMedian                float64 // tokens of the user's task
	ToolOutputMedian          float64 // tokens of one tool output
	MaxToolOutput             int
	OutputTokens              int // of every answer
	// StoredShare of the conversations chain their turns with
	// previous_response_id (the engine keeps the history); the others
	// resend the whole history every turn.
	StoredShare float64
	ThinkTime   time.Duration // mean tool run time between an answer and the next turn
}

// AgentTurn is one turn of a tool-using conversation, in Responses items.
// The answers themselves are the engine's: the client puts each one into
// the history of the turns after it, so the requests are only known as
// they are sent.
type AgentTurn struct {
	Conversation string
	Turn         int
	// Stored says the conversation chains its turns by
	// previous_response_id: turn 0 is stored, every later turn names the
	// previous turn's response and sends only its new Input.
	Stored       bool
	Instructions string
	Tools        json.RawMessage // Responses function tools, sent every turn
	// Input is what this turn adds to the conversation: the user's task on
	// turn 0, the previous answer's function call and its output later.
	Input []json.RawMessage
}

// agentTools are the function tools every agent offers.
var agentTools = json.RawMessage(`[` +
	`{"type":"function","name":"read_file","description":"Read a file of the repository.","parameters":{"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}},` +
	`{"type":"function","name":"run_tests","description":"Run the tests of a package.","parameters":{"type":"object","properties":{"package":{"type":"string"}},"required":["package"]}}` +
	`]`)

// Agent generates the agent workload over d simulated time. A turn's
// request names its predecessor in After: it is sent once the previous
// answer is in (and not before its own arrival time).
func Agent(p AgentParams, seed uint64, d time.Duration) (Workload, error) {
	const name = "agent"
	if p.ConversationRate <= 0 || p.MinTurns <= 0 || p.MaxTurns < p.MinTurns || p.Agents <= 0 || p.InstructionTokens <= 0 ||
		p.TaskMedian <= 0 || p.ToolOutputMedian <= 0 || p.OutputTokens <= 0 || p.StoredShare < 0 || p.StoredShare > 1 || p.ThinkTime <= 0 {
		return Workload{}, fmt.Errorf("workload %s: invalid parameters %+v", name, p)
	}
	rng := streamRNG(seed, name+"/arrivals")
	starts := poisson(rng, d, p.ConversationRate, func(time.Duration) float64 { return p.ConversationRate })
	instructions := make([]string, p.Agents)
	for i := range instructions {
		instructions[i] = Words(seed, fmt.Sprintf("agent/%d", i), p.InstructionTokens)
	}
	tools := []string{"read_file", "run_tests"}
	var reqs []Request
	for c, start := range starts {
		conv := fmt.Sprintf("a%d", c)
		turns := p.MinTurns + rng.IntN(p.MaxTurns-p.MinTurns+1)
		stored := rng.Float64() < p.StoredShare
		instr := instructions[rng.IntN(len(instructions))]
		task := Words(seed, conv+"/task", logNormalInt(rng, p.TaskMedian, 0.6, 8, 4*int(p.TaskMedian)))
		// The messages the engine will render, answers standing in as
		// OutputTokens words: they size the fleet's KV (DemandBlocks).
		history := []Message{{Role: "system", Content: instr}, {Role: "user", Content: task}}
		at, prev := start, ""
		for t := range turns {
			if at >= d {
				break
			}
			turn := &AgentTurn{Conversation: conv, Turn: t, Stored: stored, Instructions: instr, Tools: agentTools}
			if t == 0 {
				turn.Input = []json.RawMessage{item(map[string]any{"type": "message", "role": "user", "content": task})}
			} else {
				callID := fmt.Sprintf("call_%s_%d", conv, t)
				tool := tools[rng.IntN(len(tools))]
				args, _ := json.Marshal(map[string]string{"path": fmt.Sprintf("pkg%d/file%d.go", c, t)})
				out := Words(seed, fmt.Sprintf("%s/tool/%d", conv, t), logNormalInt(rng, p.ToolOutputMedian, 0.7, 8, max(p.MaxToolOutput, 8)))
				turn.Input = []json.RawMessage{
					item(map[string]any{"type": "function_call", "call_id": callID, "name": tool, "arguments": string(args)}),
					item(map[string]any{"type": "function_call_output", "call_id": callID, "output": out}),
				}
				history = append(history,
					Message{Role: "assistant", Content: Words(seed, fmt.Sprintf("%s/answer/%d", conv, t), p.OutputTokens)},
					Message{Role: "tool", Content: out})
			}
			key := fmt.Sprintf("%s/t%d", conv, t)
			reqs = append(reqs, Request{At: at, Key: key, After: prev, Messages: append([]Message(nil), history...),
				MaxTokens: p.OutputTokens, Agent: turn})
			prev = key
			at += time.Duration(float64(p.ThinkTime) * (0.5 + rng.Float64()))
		}
	}
	return finish(name, reqs)
}

// item marshals one Responses input item (maps marshal sorted by key, so
// the bytes are the same every run).
func item(v map[string]any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // strings and maps of strings always marshal
	}
	return b
}
