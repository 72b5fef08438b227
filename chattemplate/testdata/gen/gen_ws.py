# Generates random templates exercising jinja2 whitespace control and renders
# them with jinja2 configured as transformers does.
import json, os, random, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ref import render

random.seed(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
TEXT = ["a", "b ", " ", "  ", "\n", "\n\n", "\t", "x\n  ", "  \n", " y \n\t ", "\u00a0", "\u3000\n", "z"]
def sign(): return random.choice(["", "", "-", "+"])
def esign(): return random.choice(["", "", "-"])
def text():
    return "".join(random.choice(TEXT) for _ in range(random.randint(0, 3)))
def block(name):
    return "{%" + sign() + " " + name + " " + random.choice(["", "-", "+"]) + "%}"
def expr(e):
    return "{{" + esign() + " " + e + " " + esign() + "}}"
def comment():
    return "{#" + random.choice(["", "-", "+"]) + " c " + random.choice(["", "-", "+"]) + "#}"
def gen(depth):
    parts = []
    for _ in range(random.randint(1, 4)):
        r = random.random()
        parts.append(text())
        if r < 0.3:
            parts.append(expr(random.choice(["'v'", "i", "'\\n'"])))
        elif r < 0.45:
            parts.append(comment())
        elif r < 0.6 and depth < 3:
            parts.append(block("if true") + gen(depth+1) + random.choice(["", block("else") + gen(depth+1)]) + block("endif"))
        elif r < 0.75 and depth < 3:
            parts.append(block("for i in [1, 2]") + gen(depth+1) + block("endfor"))
        elif r < 0.85:
            parts.append(block("set x = 1"))
        else:
            parts.append(text())
    parts.append(text())
    return "".join(parts)

cases = []
for n in range(400):
    src = gen(0)
    if random.random() < 0.2:
        src += "\n"
    res = render(src, {"i": 7})
    if "out" in res:
        cases.append({"src": src, "want": res["out"]})
json.dump(cases, sys.stdout, ensure_ascii=False, indent=0)
