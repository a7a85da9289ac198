// Replays tests/firmware_vectors.json through the firmware core under MicroPython (WebAssembly).
//
// Usage: node tests/micropython/replay.mjs [VECTORS.json]
// Loads firmware/core.py, firmware/hal_emulated.py and tests/firmware_replay.py into the
// MicroPython filesystem, runs every session there and prints one JSON object on stdout:
//   {"micropython": "<sys.version>", "replies": {"<session>": ["<hex reply>", ...]}}
// tests/test_firmware_vectors.py compares those replies byte for byte with the frozen ones.
import { readFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, '..', '..');
const vectorsPath = process.argv[2] ? resolve(process.argv[2]) : join(root, 'tests', 'firmware_vectors.json');

const { loadMicroPython } = await import('@micropython/micropython-webassembly-pyscript');

// Whatever the Python side prints goes to stderr (for debugging); the result goes through a file.
const mp = await loadMicroPython({
  heapsize: 16 * 1024 * 1024,
  stdout: (line) => { process.stderr.write(line + '\n'); },
  stderr: (line) => { process.stderr.write(line + '\n'); },
});
mp.FS.mkdir('/fw');
for (const [src, dst] of [
  ['firmware/core.py', '/fw/core.py'],
  ['firmware/hal_emulated.py', '/fw/hal_emulated.py'],
  ['tests/firmware_replay.py', '/fw/firmware_replay.py'],
]) {
  mp.FS.writeFile(dst, readFileSync(join(root, src), 'utf8'));
}
mp.FS.writeFile('/fw/vectors.json', readFileSync(vectorsPath, 'utf8'));

try {
  mp.runPython(`
import sys
sys.path.insert(0, '/fw')
import json
import core
import hal_emulated
import firmware_replay
with open('/fw/vectors.json') as f:
    vectors = json.load(f)
replies = firmware_replay.run_all(vectors, core, hal_emulated)
with open('/fw/result.json', 'w') as f:
    f.write(json.dumps({'micropython': sys.version, 'implementation': sys.implementation.name,
                        'replies': replies}))
`);
} catch (e) {
  process.stderr.write(`replay.mjs: MicroPython raised: ${e}\n`);
  process.exit(1);
}
process.stdout.write(mp.FS.readFile('/fw/result.json', { encoding: 'utf8' }) + '\n');
