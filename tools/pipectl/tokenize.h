/* tokenize.h - pipectl tokenize / detokenize: text to token ids and back with a checkpoint's
 * tokenizer.json (common/tokenizer/tokenizer.h), no service involved.
 *
 *   printf '%s' "Hello world" | pipectl tokenize --tokenizer /models/llama   # 9906 1917
 *   echo "9906 1917" | pipectl detokenize --tokenizer /models/llama          # Hello world
 *
 * Same conventions as the other subcommands (pipectl.h): argv[0] is the command name, the
 * return is the exit status (0 success, 1 failure with a message on stderr, 2 bad usage). */
#ifndef PIPECTL_TOKENIZE_H
#define PIPECTL_TOKENIZE_H

struct pipectl;

/* Reads UTF-8 text from standard input, byte for byte (a trailing newline is text too), and
 * prints its ids on one line separated by spaces. --bos puts the BOS id first;
 * --special-as-text reads special-token text ("<|eot_id|>") as plain text. */
int cmd_tokenize(struct pipectl *p, int argc, char **argv);

/* Reads ids (decimal, separated by white space or commas) from standard input and writes the
 * text they decode to, as each becomes complete (a pipe from pipectl generate streams), with
 * no newline added. --skip-special leaves special tokens out; --raw writes bytes that are not
 * valid UTF-8 as they are instead of U+FFFD. */
int cmd_detokenize(struct pipectl *p, int argc, char **argv);

#endif
