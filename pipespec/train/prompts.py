"""Chat prompts for self-distillation, built combinatorially from templates and subjects.

The held-out split is disjoint from the training split by subject, not only by prompt: held-out
prompts ask about topics, skills, tasks and sentences that no training prompt mentions, so a head
cannot score on them by remembering the answers it was trained on.
"""
from __future__ import annotations

import random
import re
import zlib

TOPIC_TEMPLATES = [
    "Explain {} in simple terms.",
    "What is {}?",
    "Write a short paragraph about {}.",
    "Give me three interesting facts about {}.",
    "Why is {} important?",
    "Write a haiku about {}.",
    "Describe {} to a ten-year-old.",
    "What are the main advantages and disadvantages of {}?",
    "Summarize the history of {} in a few sentences.",
    "Write a short story that involves {}.",
    "List five questions a student might ask about {}.",
    "How would you teach {} to a beginner?",
    "Write a tweet about {}.",
    "What are common misconceptions about {}?",
    "Write a short email to a friend recommending that they learn about {}.",
    "What is the future of {}?",
]

TOPICS = [
    # science and nature
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "earthquakes", "the human heart",
    "DNA", "evolution", "climate change", "the solar system", "gravity", "electricity", "magnetism",
    "the immune system", "vaccines", "bacteria", "rainbows", "ocean tides", "coral reefs", "rainforests",
    "deserts", "glaciers", "the moon", "Mars", "stars", "the speed of light", "atoms", "chemical reactions",
    "the periodic table", "sound waves", "the brain", "sleep", "nutrition", "honey bees", "butterflies",
    "dolphins", "elephants", "penguins", "dinosaurs", "fossils", "the carbon cycle", "renewable energy",
    "solar panels", "wind turbines", "nuclear power", "batteries", "weather forecasting", "hurricanes",
    "the ozone layer", "plate tectonics", "microscopes", "telescopes", "antibiotics", "genetics",
    # technology
    "the internet", "computers", "smartphones", "artificial intelligence", "machine learning",
    "robots", "the cloud", "cybersecurity", "passwords", "email", "social media", "video games",
    "programming", "databases", "open source software", "3D printing", "electric cars", "self-driving cars",
    "drones", "satellites", "GPS", "virtual reality", "blockchain", "encryption", "operating systems",
    "web browsers", "search engines", "compilers", "the binary number system", "algorithms",
    # history and society
    "the Roman Empire", "ancient Egypt", "the printing press", "the Industrial Revolution",
    "the Renaissance", "the French Revolution", "the Silk Road", "the Olympic Games", "democracy",
    "the United Nations", "money", "banks", "inflation", "taxes", "trade", "cities", "public libraries",
    "museums", "newspapers", "the radio", "television", "photography", "cinema", "jazz music",
    "classical music", "poetry", "theater", "architecture", "bridges", "castles", "pyramids",
    "the Great Wall of China", "maps", "calendars", "clocks", "writing systems", "languages",
    "volunteering", "recycling", "public transportation", "urban gardens", "human rights",
    # everyday life
    "breakfast", "coffee", "tea", "chocolate", "bread", "pizza", "rice", "vegetables", "fruit",
    "cooking at home", "healthy eating", "exercise", "running", "yoga", "meditation", "friendship",
    "family", "pets", "dogs", "cats", "gardening", "houseplants", "reading books", "libraries",
    "time management", "saving money", "budgeting", "job interviews", "teamwork", "leadership",
    "public speaking", "learning a new language", "homework", "online learning", "travel", "camping",
    "hiking", "the beach", "mountains", "winter", "summer", "holidays", "birthdays", "weddings",
    "moving to a new city", "first aid", "road safety", "kindness", "curiosity", "creativity", "patience",
    "happiness", "stress", "good habits", "procrastination", "minimalism", "board games", "chess",
    "football", "basketball", "tennis", "swimming", "cycling", "music lessons", "painting", "drawing",
    "photography as a hobby", "knitting", "woodworking", "baking cakes", "composting", "bird watching",
    "astronomy as a hobby", "fishing", "sailing", "skiing", "trains", "airplanes", "ships", "bicycles",
    "umbrellas", "paper", "glass", "plastic", "water", "fire", "wind", "snow", "clouds", "forests",
    "rivers", "islands", "farms", "markets", "restaurants", "hospitals", "schools", "universities",
]

SKILL_TEMPLATES = [
    "Give me some tips for {}.",
    "How do I get started with {}?",
    "What do I need for {}?",
    "Make a simple one-week plan for {}.",
    "What mistakes do beginners make when {}?",
]

SKILLS = [
    "learning to swim", "learning to play the guitar", "learning to cook", "running a marathon",
    "writing a novel", "starting a small business", "learning Python", "studying for exams",
    "growing tomatoes", "training a puppy", "learning to draw", "improving my sleep", "saving for a car",
    "planning a road trip", "writing a resume", "learning to juggle", "building a website",
    "organizing my desk", "learning chess", "keeping a journal", "making new friends", "baking bread",
    "learning to type faster", "reducing screen time", "speaking confidently", "learning to ski",
    "starting a podcast", "taking better photos", "learning Spanish", "eating more vegetables",
    "learning to knit", "climbing a mountain", "painting with watercolors", "memorizing a speech",
    "caring for a cat", "learning to dance", "cleaning the house quickly", "learning to sing",
    "doing push-ups", "writing poetry", "managing a team", "learning to code games", "building a birdhouse",
    "learning the piano", "meditating every day", "learning to sew", "brewing coffee at home",
]

CODE_TEMPLATES = [
    "Write a Python function that {}.",
    "Write a JavaScript function that {}.",
    "Explain how to write code that {}.",
    "Write a C function that {}.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of a number",
    "returns the largest element of a list", "counts the vowels in a string", "sorts a list of numbers",
    "computes the Fibonacci sequence", "checks whether a string is a palindrome", "sums a list of numbers",
    "removes duplicates from a list", "converts Celsius to Fahrenheit", "finds the average of a list",
    "merges two sorted lists", "counts the words in a sentence", "capitalizes every word in a string",
    "computes the greatest common divisor of two numbers", "checks whether a year is a leap year",
    "finds the second largest number in a list", "flattens a nested list", "computes the power of a number",
    "returns the even numbers of a list", "counts how often each character appears in a string",
    "reads a file and prints its lines", "generates a random password", "converts a number to binary",
    "checks whether two strings are anagrams", "finds the minimum of three numbers",
    "computes the area of a circle", "returns the length of the longest word in a sentence",
    "implements binary search", "implements bubble sort", "transposes a matrix",
    "counts the lines in a text file", "validates an email address", "rounds a number to two decimals",
    "computes the sum of the digits of a number", "checks whether a list is sorted",
    "finds the index of an element in a list", "swaps two variables", "prints a multiplication table",
]

MATH_TEMPLATES = [
    "What is {a} plus {b}?",
    "What is {a} times {b}?",
    "What is {a} minus {b}?",
    "If I have {a} apples and give away {b}, how many do I have left?",
    "A train travels {a} kilometers in {b} hours. What is its average speed?",
    "How many minutes are there in {a} hours?",
    "What is {b} percent of {a}?",
    "Convert {a} kilometers to miles.",
]

SENTENCE_TEMPLATES = [
    "Rewrite this sentence to sound more formal: \"{}\"",
    "Correct any grammar mistakes in this sentence: \"{}\"",
    "Translate this sentence into French: \"{}\"",
    "Summarize this sentence in five words: \"{}\"",
]

SENTENCES = [
    "i think we should go to the park tomorrow if it dont rain",
    "The meeting has been moved to next Tuesday afternoon.",
    "my brother like to play football with his friends every weekend",
    "Please send me the report before the end of the day.",
    "The cat sat on the mat and looked out of the window.",
    "we was late because the bus didnt come on time",
    "I would like to order a large pizza with mushrooms.",
    "The library is closed on Sundays and public holidays.",
    "She have been working at the hospital for ten years.",
    "Can you help me carry these boxes to the car?",
    "The weather today is sunny with a light breeze.",
    "they goes to school by bike every morning",
    "Our team won the championship after a difficult season.",
    "I forgot my umbrella and got wet on the way home.",
    "The new restaurant downtown serves excellent noodles.",
    "He dont know where he put his keys.",
    "Thank you for inviting me to your birthday party.",
    "The train to the city leaves every twenty minutes.",
    "me and my friend watched a movie last night",
    "The museum has a large collection of ancient coins.",
    "Remember to water the plants while I am away.",
    "This phone is faster than the one I had before.",
    "The children played in the snow all afternoon.",
    "Its important to drink enough water every day.",
]


# Everyday requests of kinds the templates above never produce, written for evaluation only (issue 49:
# a head that scores well on its own templates may still generalise poorly). No training prompt
# comes from here; `eval-mtp --prompt-set everyday` answers them.
EVERYDAY = {
    "poem": [
        "Write a limerick about a forgetful cat.", "Write a four-line poem about the first day of spring.",
        "Write a short rhyming poem for my grandmother's 80th birthday.",
        "Write a poem about waiting for a bus in the rain.", "Write a sonnet about a lighthouse keeper.",
        "Write a funny poem about Monday mornings.", "Write a poem that a child could recite about the stars.",
        "Write a short poem about the smell of fresh bread.",
    ],
    "recipe": [
        "Give me a recipe for a quick vegetable soup.", "How do I make pancakes without eggs?",
        "Give me a simple recipe for tomato pasta for two people.", "How do I cook rice so it is not sticky?",
        "What can I cook with potatoes, onions and cheese?", "Give me a recipe for banana bread.",
        "How do I make a fruit smoothie for breakfast?", "Give me a recipe for a green salad with a lemon dressing.",
    ],
    "email": [
        "Write a polite email asking my landlord to fix the heating.",
        "Write an email to my manager asking for Friday off.",
        "Write a thank-you note to a teacher at the end of the school year.",
        "Write an email apologizing to a customer for a late delivery.",
        "Write a short message inviting my neighbours to a garden party.",
        "Write an email to a colleague asking for feedback on my presentation.",
        "Write a letter to the city council about a broken street light.",
        "Write an email declining a job offer politely.",
    ],
    "child": [
        "Explain to a five-year-old why the sky gets dark at night.", "How would you explain to a child what money is?",
        "Explain to a seven-year-old why we need to brush our teeth.",
        "Explain to a child why leaves change colour in autumn.", "How do airplanes stay in the air? Explain it to a kid.",
        "Explain to a young child what a computer does.", "Why do we have to sleep? Explain it to a child.",
        "Explain to a child where rain comes from.",
    ],
    "code": [
        "Write a Python class for a bank account with deposit and withdraw methods.",
        "Write a SQL query that lists the ten most expensive products in a table called products.",
        "Write a bash command that counts the files in a folder.", "Write a Python script that prints the current date and time.",
        "Write an HTML page with a heading and a button.", "Show me how to read a CSV file in Python and print each row.",
        "How do I loop over a dictionary in Python? Show an example.",
        "Write a JavaScript snippet that changes the text of a paragraph when a button is clicked.",
    ],
    "riddle": [
        "Tell me a riddle and its answer.", "Tell me a joke about computers.", "Tell me a knock-knock joke.",
        "Give me a brain teaser for a dinner party.", "Tell me a pun about vegetables.",
        "Make up a riddle whose answer is a shadow.", "Tell me a clean joke I can tell at work.",
        "Give me three silly jokes for kids.",
    ],
    "plan": [
        "Plan a relaxing Saturday in a small town.", "Make a packing list for a weekend camping trip.",
        "Plan a three-day trip to Rome on a budget.", "Make a shopping list for a week of simple dinners.",
        "Plan a birthday party for a ten-year-old.", "Make a study schedule for the week before an exam.",
        "Plan a morning routine that starts at six o'clock.", "Make a checklist for moving into a new flat.",
    ],
    "advice": [
        "My friend is upset with me for forgetting her birthday. What should I say?",
        "I can't fall asleep at night. What can I try?", "How do I ask for a raise?",
        "I have too many browser tabs open and feel overwhelmed. Any advice?",
        "How can I be more productive when working from home?", "What should I say in my first meeting with a new team?",
        "How do I stay calm before a big exam?", "My plants keep dying. What am I doing wrong?",
    ],
    "describe": [
        "Write a short product description for a reusable water bottle.",
        "Describe a busy train station in the morning.", "Describe the perfect cup of coffee.",
        "Write an advertisement for a neighbourhood bakery.", "Describe a quiet forest after snowfall.",
        "Write a short review of a cozy cafe.", "Describe what a modern kitchen looks like.",
        "Write a listing for a small flat for rent near the city centre.",
    ],
    "dialogue": [
        "Write a short dialogue between a customer and a baker.",
        "Write a conversation between two friends planning a trip.",
        "Write a dialogue where a student asks a teacher for help with homework.",
        "Write a short scene where a robot meets a cat for the first time.",
        "Write a phone call between a doctor's receptionist and a patient booking an appointment.",
        "Write a dialogue between a tourist asking for directions and a local.",
        "Write a short interview with an astronaut.", "Write a conversation between a parent and a child about chores.",
    ],
}


def everyday_prompts() -> list[str]:
    """The `EVERYDAY` requests, one of each kind in turn, so any first N mix the kinds."""
    kinds = list(EVERYDAY.values())
    return [kind[i] for i in range(max(map(len, kinds))) for kind in kinds if i < len(kind)]


def held_out(subject: str, fraction: float = 0.15) -> bool:
    # stable across runs and machines (unlike hash()): a subject's side never changes
    return zlib.crc32(subject.encode()) % 1000 < fraction * 1000


def chat_prompts(split: str, heldout_fraction: float = 0.15, seed: int = 0) -> list[str]:
    """Every prompt of one split ("train" or "heldout"), in a seeded order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    want_heldout = split == "heldout"
    prompts = []

    def add(templates, subjects):
        for subject in subjects:
            if held_out(subject, heldout_fraction) == want_heldout:
                prompts.extend(t.format(subject) for t in templates)

    add(TOPIC_TEMPLATES, TOPICS)
    add(SKILL_TEMPLATES, SKILLS)
    add(CODE_TEMPLATES, CODE_TASKS)
    add(SENTENCE_TEMPLATES, SENTENCES)
    rng = random.Random(1234)                      # the numbers of math prompts, same for both splits
    for i in range(240):
        a, b = rng.randint(2, 500), rng.randint(2, 99)
        template = MATH_TEMPLATES[i % len(MATH_TEMPLATES)]
        key = f"math-{a}-{b}"
        if held_out(key, heldout_fraction) == want_heldout:
            prompts.append(template.format(a=a, b=b))
    prompts = sorted(set(prompts))
    random.Random(seed).shuffle(prompts)
    return prompts


_WORD = re.compile(r" [a-z]{5,}")


def heldout_words(heldout_fraction: float = 0.15) -> set[str]:
    """Every word of every held-out subject, lower case: what no training prompt may mention."""
    words = set()
    for subjects in (TOPICS, SKILLS, CODE_TASKS, SENTENCES):
        for subject in subjects:
            if held_out(subject, heldout_fraction):
                words.update(re.findall(r"[a-z]+", subject.lower()))
    return words


def vocabulary_prompts(tokenizer, count: int, heldout_fraction: float = 0.15, seed: int = 0) -> list[str]:
    """`count` training prompts on words of the target's own vocabulary (tokens that decode to a space
    and five or more lower-case letters: mostly whole words, some word starts), a topic template
    each: ~15,000 subjects for SmolLM2's vocabulary where the lists above hold a few hundred, so that
    the answers a head learns from cover more of what people ask about. A word of any held-out
    subject is never used, so no training prompt mentions the held-out split's subjects."""
    banned = heldout_words(heldout_fraction)
    words = sorted({t.strip() for t in (tokenizer.decode([i]) for i in range(tokenizer.vocab_size))
                    if _WORD.fullmatch(t) and t.strip() not in banned})
    rng = random.Random(seed)
    rng.shuffle(words)
    return [rng.choice(TOPIC_TEMPLATES).format(words[i % len(words)]) for i in range(min(count, 4 * len(words)))]
